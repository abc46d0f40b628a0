"""`rollout.placement: colocated` on CPU (seed 004's hybrid engine): megarl-train starts its
megarl-server on the same cores and, every step, wakes it, hands the weights over through shared
memory, lets it generate, puts it to sleep and trains. Real trainer, real rollout manager, real
megarl-server; what happened is read from the server's own log (its sleeps and wakes, and where
the weight bytes came through) and from the trainer's timeline and metrics. The SIGKILL + resume
of a colocated run is `test_resume_exactly_once.py`'s colocated case."""
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 40
LOG = re.compile(r"(release|resume)_memory_occupation (\S+) at ([0-9.]+); weight bytes so far: "
                 r"socket (\d+), shared memory (\d+)")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("colocated")
    out = tmp / "run"
    cmd = [sys.executable, "-m", "megarl.train", os.path.join(REPO, "configs", "tiny_grpo.yaml"),
           f"model.hf_path={REPO}/examples/tiny/model", f"train.run_dir={out}", "checkpoint.hf_export_dir=",
           f"data.train_path={REPO}/examples/tiny/data/rl_prompts.jsonl",
           f"data.eval_path={REPO}/examples/tiny/data/eval_prompts.jsonl", f"train.steps={STEPS}",
           "train.global_batch_size=128", f"rollout.eval_interval={STEPS}", "rollout.eval_size=500",
           "rollout.placement=colocated", "rollout.max_staleness=0", "weights.transport=shm",
           "logging.timeline=true"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=str(tmp),
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_the_server_sleeps_through_every_update(run):
    events = [LOG.search(line) for line in (run / "servers" / "server0.log").read_text().splitlines()]
    events = [(m[1], m[2], float(m[3])) for m in events if m]
    sleeps = [t for kind, _, t in events if kind == "release"]
    wakes = [t for kind, _, t in events if kind == "resume"]
    assert len(sleeps) == len(wakes) == STEPS, events[:4]
    assert all(tags == "kv_cache,weights" for _, tags, _ in events)
    updates = [json.loads(line) for line in (run / "timeline" / "rank0.jsonl").read_text().splitlines()]
    updates = [(u["start"], u["end"]) for u in updates if u["name"] == "update"]
    assert len(updates) == STEPS
    for (start, end), asleep, awake in zip(updates, sleeps, wakes):
        assert asleep <= start and end <= awake, (asleep, start, end, awake)  # the server's own clock


def test_no_weight_byte_crosses_a_socket(run):
    last = [LOG.search(line) for line in (run / "servers" / "server0.log").read_text().splitlines()]
    last = [m for m in last if m][-1]
    assert int(last[4]) == 0  # every push went through /dev/shm
    assert int(last[5]) >= STEPS * 2_300_000 * 0.9  # the tiny model's 2.3 MB, at least once per push


def test_on_policy_and_learning(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r["step"] == 1)
    assert first["mismatch/onpolicy_frac"] == 1.0 and first["mismatch/mean"] <= 1e-4, first
    assert all(r["staleness_max"] == 0 for r in rows if r["step"] >= 1)
    acc = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    assert len(acc) == 2 and acc[1] >= acc[0] + 0.04, acc  # 500 prompts: SE ~0.021 each
