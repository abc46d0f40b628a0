"""Kill the trainer (SIGKILL) mid-run at max_staleness 2, resume from the last checkpoint, and
check over the epoch: every prompt trained exactly once, none lost, none repeated, and the
staleness bound held in every batch of both runs (real trainer, real local server). The same for
a colocated run (rollout.placement colocated: on-policy, the server sleeping through every update,
weights handed over through shared memory)."""
import collections
import json
import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS, GROUP, GROUPS_PER_STEP = 24, 4, 4  # one epoch = 6 steps


PLACEMENTS = {
    "disaggregated": ["rollout.max_staleness=2",
                      "rollout.staleness_hard_cap=0"],  # the strict rule: every trained token within 2
    "colocated": ["rollout.placement=colocated", "rollout.max_staleness=0", "weights.transport=shm"],
}


def command(run, data, placement: str = "disaggregated") -> list[str]:
    return [sys.executable, "-m", "megarl.train", os.path.join(REPO, "configs", "tiny_grpo.yaml"),
            f"model.hf_path={REPO}/examples/tiny/model", f"data.train_path={data}", "data.eval_path=",
            f"train.run_dir={run}", "checkpoint.hf_export_dir=", "checkpoint.save_interval=2",
            "train.steps=9", f"train.global_batch_size={GROUP * GROUPS_PER_STEP}",
            f"rollout.group_size={GROUP}", "logging.dump_generations=true", *PLACEMENTS[placement]]


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in open(path).read().splitlines()] if os.path.exists(path) else []


def latest_checkpoint_step(run) -> int:
    names = [n for n in os.listdir(run / "checkpoints") if n.startswith("step_")
             and os.path.exists(run / "checkpoints" / n / "megarl.json")]
    return max(int(n.split("_")[1]) for n in names)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_sigkill_and_resume_trains_every_prompt_exactly_once(tmp_path, placement):
    data = tmp_path / "prompts.jsonl"
    lines = open(f"{REPO}/examples/tiny/data/rl_prompts.jsonl").read().splitlines()[:PROMPTS]
    data.write_text("\n".join(lines) + "\n")
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")

    # run 1: killed (with its local server: the whole process group) once step 3 is logged
    proc = subprocess.Popen(command(run, data, placement), cwd=str(tmp_path), env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "run1.err", "w"))
    deadline = time.monotonic() + 300
    while not any(r["step"] >= 3 for r in read_jsonl(run / "metrics.jsonl")):
        assert proc.poll() is None, open(tmp_path / "run1.err").read()[-3000:]
        assert time.monotonic() < deadline, "run 1 never reached step 3"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    saved = latest_checkpoint_step(run)
    assert saved >= 2
    rows1 = read_jsonl(run / "metrics.jsonl")
    gens1 = [g for g in read_jsonl(run / "generations.jsonl") if g["step"] <= saved]  # the rest rolled back
    os.rename(run / "generations.jsonl", tmp_path / "generations_run1.jsonl")
    os.rename(run / "metrics.jsonl", tmp_path / "metrics_run1.jsonl")

    # run 2: the same command resumes from the checkpoint and finishes
    done = subprocess.run(command(run, data, placement), cwd=str(tmp_path), env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows2 = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows2] == list(range(saved + 1, 10))
    check_exactly_once(gens1 + read_jsonl(run / "generations.jsonl"), rows1 + rows2)


def check_exactly_once(gens: list[dict], rows: list[dict]) -> None:
    """Over both runs' generations and metrics rows: every draw of the prompt stream trained in
    exactly one step with its whole group, nothing lost, the staleness bound held."""
    # every draw of the prompt stream is trained in exactly one step, with its whole group
    steps_of = collections.defaultdict(set)
    samples_of = collections.Counter()
    for g in gens:
        steps_of[g["draw"]].add(g["step"])
        samples_of[g["draw"]] += 1
    assert all(len(s) == 1 for s in steps_of.values()), {d: s for d, s in steps_of.items() if len(s) > 1}
    assert set(samples_of.values()) == {GROUP}
    first_epoch = [d for d in steps_of if d < PROMPTS]
    assert sorted(first_epoch) == list(range(PROMPTS))  # nothing lost
    prompts = [g["prompt_index"] for g in gens if g["draw"] < PROMPTS]
    assert collections.Counter(prompts) == {i: GROUP for i in range(PROMPTS)}
    assert len(steps_of) == 9 * GROUPS_PER_STEP  # 9 steps of 4 groups, each a distinct draw
    for r in rows:
        assert r["staleness_max"] <= 2, r
