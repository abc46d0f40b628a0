"""The run-time gates on real runs (real trainer, rollout manager and megarl-server; short demo
runs): the train-rollout mismatch gate stops a run whose server computes another model, and
checksum verification catches a server tensor changed behind the trainer's back."""
import json
import os
import shutil

import harness
import pytest
import torch
from e2e_servers import ForwardingProxy, ServerProc, http

from megarl.protocol.tensor_wire import tensor_update

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = f"{REPO}/examples/tiny/model"


def train(tmp_path, *overrides, steps: int = 3) -> harness.Run:
    return harness.train(tmp_path / "run", "checkpoint.save_interval=0", "train.global_batch_size=64",
                         "rollout.eval_at_start=false", f"train.steps={steps}",
                         "weights.verify_interval=1", *overrides, timeout=300)  # checksums of every push


def test_mismatch_gate_stops_a_run_whose_server_runs_another_model(tmp_path):
    """The server loads the demo model with rope_theta 100 instead of 10000 (a config the weight
    push does not carry): its weights are bitwise the trainer's (the checksums agree), its
    logprobs are not, and the run stops at step 1 with one line."""
    wrong = tmp_path / "wrong_rope"
    shutil.copytree(MODEL, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["rope_theta"] = 100.0
    (wrong / "config.json").write_text(json.dumps(cfg))
    server = ServerProc(str(wrong)).wait_ready()
    try:
        # the push synchronous (weights.overlap off): step 1's own push is verified within step 1
        run = train(tmp_path, f"rollout.servers=[{server.url}]", "weights.overlap=false")
    finally:
        server.stop()
    assert run.returncode == 1, run.stderr[-3000:]
    line, rows = run.last_line, run.rows
    assert line.startswith("megarl-train: MismatchError: train.mismatch_gate: at step 1"), line
    assert "likely causes" in line and "> 0.0001 nats" in line
    assert [r["step"] for r in rows] == [1]  # the offending step is logged, no later one runs
    r = rows[0]
    assert r["mismatch/onpolicy_frac"] == 1.0  # step 1: every token from the pushed version 0
    assert r["mismatch/mean"] > 1e-2 and r["mismatch/max"] >= r["mismatch/mean"]
    assert r["push/verify_mismatches"] == 0  # the weights are right; the model around them is not


def test_a_bf16_server_fails_verification_before_any_rollout(tmp_path):
    """A server that rounds the fp32 push to bf16 cannot hold it: the checksums of the initial
    push differ and the run stops before step 1, naming the server and a tensor."""
    run = train(tmp_path, "rollout.server_args=[--dtype,bfloat16]")
    assert run.returncode == 1, run.stderr[-3000:]
    line, rows = run.last_line, run.rows
    assert "weights.verify_interval: server http://127.0.0.1:" in line, line
    assert "than the trainer pushed as version 0" in line and "tensor(s) differ" in line
    assert rows == []


def test_mismatch_gate_catches_a_bf16_server_when_verification_is_off(tmp_path):
    run = train(tmp_path, "rollout.server_args=[--dtype,bfloat16]", "weights.verify_interval=0")
    assert run.returncode == 1, run.stderr[-3000:]
    assert "train.mismatch_gate: at step 1" in run.last_line
    rows = run.rows
    assert 1e-4 < rows[0]["mismatch/mean"] and "push/verify_mismatches" not in rows[0]


class TamperingProxy(ForwardingProxy):
    """Forwards everything to the server; just before the n-th /weights_checksum it changes
    model.norm.weight on the server itself (its own /update_weights_from_tensor endpoint)."""

    def __init__(self, target: str, n: int):
        self.calls, self.n = 0, n
        super().__init__(target, self.on_path)

    def on_path(self, path: str) -> None:
        if path == "/weights_checksum":
            self.calls += 1
            if self.calls == self.n:
                body = tensor_update({"model.norm.weight": torch.full((128,), 0.5)}).to_json()
                code, out = http("POST", self.target + "/update_weights_from_tensor", body)
                assert code == 200, out


@pytest.mark.parametrize("mode", ["warn", "fail", "fail-overlapped"])
def test_checksum_verify_detects_a_tampered_server_tensor(tmp_path, mode):
    server = ServerProc(MODEL).wait_ready()
    overlapped = mode.endswith("-overlapped")
    mode = mode.split("-")[0]
    try:
        proxy = TamperingProxy(server.url, n=2)  # 1: the initial push, 2: step 1's push
        # the tampered server generates until the next push: the mismatch gate would stop the warn
        # run at step 2 (that is its job); off here, to see what verification alone does
        run = train(tmp_path, f"rollout.servers=[{proxy.url}]", f"weights.verify_mode={mode}",
                    "weights.transport=tensor", f"train.mismatch_gate={mode == 'fail'}",
                    f"weights.overlap={overlapped}")
    finally:
        server.stop()
    rows = run.rows
    if mode == "fail":
        assert run.returncode == 1, run.stderr[-3000:]
        line = run.last_line
        assert f"weights.verify_interval: server {proxy.url} holds a different model.norm.weight " \
               "than the trainer pushed as version 1 (1 tensor(s) differ on 1 server(s)" in line, line
        # synchronous: step 1 stops before its metrics are logged; overlapped, step 1's push is
        # checked in its flight and judged where it lands - step 2's push - so step 1 is logged
        assert [r["step"] for r in rows] == ([1] if overlapped else []), rows
        return
    run.check()
    # counted at step 1; step 2's push overwrites the tampered tensor and verifies clean (synchronous
    # pushes: the fail-overlapped case covers the flight's check)
    assert [r["push/verify_mismatches"] for r in rows] == [1, 0, 0]
    assert "WARNING weights.verify_interval" in run.stdout
    assert proxy.calls == 4 and all(r["push/digest_s"] > 0 for r in rows)


def test_a_tempered_run_trains_the_distribution_it_sampled(tmp_path):
    """rollout.temperature=0.6: the server reports log softmax(logits / 0.6) of each sampled token
    (SGLang's default) and the trainer scores the same distribution, so the gate passes every step
    at fp32 noise; the logprobs are those of the HF model at 0.6 (recomputed here with
    transformers), not at temperature 1."""
    transformers = pytest.importorskip("transformers")
    from megarl.common.tokenizer import load_tokenizer
    from megarl.data.prompts import PromptDataset

    run = train(tmp_path, "rollout.temperature=0.6", "logging.dump_generations=true").check()
    rows = run.rows
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # measured ~1e-7 mean; at temperature 1 scoring, 0.6-sampled tokens read ~0.1
        assert r["mismatch/mean"] <= 1e-5 and r["mismatch/max"] <= 1e-4, r
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    prompts = PromptDataset(f"{REPO}/examples/tiny/data/rl_prompts.jsonl", load_tokenizer(MODEL)).samples
    first = [g for g in run.generations if g["step"] == 1][:16]  # version 0: the model in MODEL
    gap_to_t1 = 0.0
    for g in first:
        ids = prompts[g["prompt_index"]].prompt_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids + g["response_ids"]])).logits[0, len(ids) - 1:-1].double()
        tok = torch.tensor(g["response_ids"])[:, None]
        want = torch.log_softmax(logits / 0.6, -1).gather(1, tok)[:, 0]
        at_one = torch.log_softmax(logits, -1).gather(1, tok)[:, 0]
        got = torch.tensor(g["behave_logp"], dtype=torch.float64)
        assert (got - want).abs().max() < 1e-4, (g, want)
        gap_to_t1 = max(gap_to_t1, (got - at_one).abs().max().item())
    assert gap_to_t1 > 1e-2, gap_to_t1
