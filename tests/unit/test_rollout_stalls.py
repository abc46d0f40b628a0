"""Nothing in the rollouts waits forever: the real controller, client, SingleTurnWorkflow and
RewardCaller against loopback servers that misbehave - one accepts connections and never answers,
one refuses every /generate with HTTP 400, one answers while the reward never returns, and a
push waits for requests on the silent server. Each ends within seconds with one line naming the
stalled phase, the server and the server's own message."""
from __future__ import annotations

import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megarl.data.datasets import PromptSample
from megarl.data.sampler import ResumableSampler
from megarl.rewards import RewardCaller
from megarl.rollout.cluster import RolloutCluster
from megarl.rollout.controller import RolloutController, RolloutFailed, RolloutStalled
from megarl.protocol.types import SamplingParams
from megarl.rollout.workflows import SingleTurnWorkflow, WorkflowContext

REFUSAL = "sampling_params.top_k=1000 out of range [-1, 16]"


class Tok:
    eos_id = 2

    def encode(self, text: str) -> list[int]:
        return [3 + ord(c) % 10 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(str(i - 3) for i in ids)


class _Generate(BaseHTTPRequestHandler):
    """/generate: three tokens and EOS for each prompt of the body, a list for a batch as SGLang
    answers (``refuse``: HTTP 400 with SGLang's error body)."""

    refuse = False
    calls = 0

    def log_message(self, *args):
        pass

    def do_POST(self):
        ids = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["input_ids"]
        type(self).calls += 1
        if self.refuse:
            code, body = 400, {"object": "error", "message": REFUSAL, "code": 400}
        else:
            out = [4, 5, 2]
            one = {"output_ids": out, "text": "12", "meta_info": {
                "finish_reason": {"type": "stop"}, "weight_version": "0",
                "output_token_logprobs": [[-0.5, t, None] for t in out]}}
            code, body = 200, ([one] * len(ids) if isinstance(ids[0], list) else one)
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def http_server():
    servers = []

    def start(refuse: bool) -> str:
        handler = type("Handler", (_Generate,), {"refuse": refuse, "calls": 0})
        srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()


@pytest.fixture
def silent_server():
    """Accepts connections and reads nothing, answers nothing (a hung server process)."""
    lsock = socket.create_server(("127.0.0.1", 0))
    held, stop = [], threading.Event()

    def accept():
        lsock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(lsock.accept()[0])
            except OSError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{lsock.getsockname()[1]}"
    stop.set()
    for s in held:
        s.close()
    lsock.close()


def make(address: str, reward_fn=None, **kw) -> RolloutController:
    tok = Tok()
    reward = RewardCaller(reward_fn or (lambda p, c, m: 1.0), timeout_s=0)
    ctx = WorkflowContext(tok, reward, SamplingParams(max_new_tokens=4, stop_token_ids=[2]), 2)
    data = [PromptSample(i, f"p{i}", {}, [1, 3 + i % 10]) for i in range(32)]
    args = dict(batch_groups=2, max_staleness=1, max_concurrent=4, max_retries=2)
    args.update(kw)
    return RolloutController(data, SingleTurnWorkflow(ctx), [address], RolloutCluster([], driver=False), **args)


def test_silent_server_is_a_stall_naming_the_phase_and_the_server(silent_server):
    c = make(silent_server)
    c.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(RolloutStalled) as e:
            c.next_batch(2, timeout_s=2.0)
    finally:
        c.stop()
    assert 2.0 <= time.monotonic() - t0 < 5.0
    msg = str(e.value)
    assert "\n" not in msg and "0/2 groups after 2 s of waiting for the step (train.stall_timeout_s)" in msg
    assert "phase: generate" in msg and f"{silent_server} (4)" in msg  # 4 episodes, one batched request each
    assert "4 episode(s) running" in msg


def test_refused_requests_stop_the_run_with_the_servers_message(http_server, tmp_path):
    url = http_server(refuse=True)
    c = make(url, failed_log=str(tmp_path / "failed.jsonl"), max_consecutive_failures=5)
    c.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(RolloutFailed) as e:
            c.next_batch(2, timeout_s=60.0)
    finally:
        c.stop()
    assert time.monotonic() - t0 < 5.0  # not the 60 s deadline
    msg = str(e.value)
    assert msg.startswith("rollout: 5 prompts in a row failed with the same error (rollout.max_consecutive_failures)")
    assert f"{url}: HTTP 400: {REFUSAL}" in msg
    failed = [json.loads(x) for x in (tmp_path / "failed.jsonl").read_text().splitlines()]
    assert len(failed) >= 5 and {f["attempts"] for f in failed} == {1}  # a 4xx is not retried
    assert c.counters["retries"] == 0


def test_a_success_in_between_resets_the_failure_count(http_server):
    """One episode at a time; the 2nd and 4th prompts drawn fail: never 2 in a row, no stop."""
    # max_staleness 3: room for 4 batches at version 0 (the stand-in server reports version 0)
    c = make(http_server(refuse=False), max_consecutive_failures=2, max_retries=0, max_concurrent=1,
             max_staleness=3)
    order = ResumableSampler(32, seed=0)
    failing = [order.next_index() for _ in range(4)][1::2]
    run = c.workflow.arun_episode

    async def flaky(client, sample):
        if sample.index in failing:
            raise RuntimeError("refused")
        return await run(client, sample)

    c.workflow.arun_episode = flaky
    c.start()
    try:
        for _ in range(3):
            assert len(c.next_batch(2, timeout_s=20.0)) == 4
    finally:
        c.stop()
    assert c.counters["failed"] == 2


def test_reward_that_never_returns_is_a_stall_in_the_reward_phase(http_server):
    release = threading.Event()

    def hung(prompt, completion, meta):  # a sync verifier on the thread executor, no timeout
        release.wait()
        return 1.0

    c = make(http_server(refuse=False), reward_fn=hung)
    c.start()
    try:
        with pytest.raises(RolloutStalled) as e:
            c.next_batch(2, timeout_s=2.0)
    finally:
        release.set()
        c.stop()
    msg = str(e.value)
    assert re.search(r"phase: reward \(8 call\(s\) running, oldest [12] s\)", msg), msg
    assert "requests in flight: none" in msg


def test_push_waiting_for_a_hung_server_fails_within_the_push_deadline(silent_server):
    """Without partial rollouts a push waits for in-flight requests to finish under the old
    weights; a hung server's never do: the hold ends after weights.timeout_s, naming it."""
    c = make(silent_server, partial_rollout=False, hold_timeout_s=1.0)
    c.start()
    try:
        deadline = time.monotonic() + 5
        while c.client is None or not any(s.inflight for s in c.client.servers):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(RolloutStalled) as e:
            c.hold()
        assert time.monotonic() - t0 < 3.0
        c.release()
    finally:
        c.stop()
    msg = str(e.value)
    assert msg.startswith("weight push stalled: requests still running under the old weights after 1 s")
    assert "phase: held for a weight push" in msg and silent_server in msg


class _Cluster:
    timeout_s = 0.3

    def __init__(self):
        self.ended = []

    def end_push(self, version):
        self.ended.append(version)


def test_push_tail_does_not_publish_a_version_whose_load_is_still_running():
    """The manager's finish_push: with a weight-update call still in flight past weights.timeout_s
    the version is not flipped (end_push(None): resume only) and the push's tail fails, naming it."""
    from megarl.rollout.manager import RolloutManager

    m = RolloutManager(spec=None)
    m.cluster = _Cluster()
    m._inflight = 1  # an /update_weights_from_* call that never returned
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"weight push stalled: 1 weight-update call\(s\) still running after "
                                           r"0.3 s \(weights.timeout_s\); version 4 not published"):
        m.finish_push(4)
    assert 0.3 <= time.monotonic() - t0 < 2.0 and m.cluster.ended == [None]
    m._inflight = 0
    assert "commit_s" in m.finish_push(5) and m.cluster.ended == [None, 5]
