"""Kill the trainer (SIGKILL) mid-run at max_staleness 2, resume from the last checkpoint, and
check over the epoch: every prompt trained exactly once, none lost, none repeated, and the
staleness bound held in every batch of both runs (real trainer, real local server). The same for
a colocated run (rollout.placement colocated: on-policy, the server sleeping through every update,
weights handed over through shared memory).

The stop-then-resume frame (`prompts`, `OVERRIDES`, `until_step`, `resume_and_check`) is shared
with test_rollout_manager.py and test_manager_liveness.py, which stop the run in other ways."""
import collections
import os
import signal
import time

import pytest

import harness

PROMPTS, GROUP, GROUPS_PER_STEP = 24, 4, 4  # one epoch = 6 steps

PLACEMENTS = {
    "disaggregated": ("rollout.max_staleness=2",
                      "rollout.staleness_hard_cap=0"),  # the strict rule: every trained token within 2
    "colocated": ("rollout.placement=colocated", "rollout.max_staleness=0", "weights.transport=shm"),
}
# 9 steps of 4 groups of 4, a checkpoint every 2 steps, every trained sample dumped
OVERRIDES = ("checkpoint.save_interval=2", "train.steps=9", f"train.global_batch_size={GROUP * GROUPS_PER_STEP}",
             f"rollout.group_size={GROUP}", "logging.dump_generations=true")


def prompts(tmp_path):
    """The demo's first PROMPTS training prompts: an epoch is 6 steps, so 9 steps start a second."""
    data = tmp_path / "prompts.jsonl"
    lines = (harness.TINY / "data" / "rl_prompts.jsonl").read_text().splitlines()[:PROMPTS]
    data.write_text("\n".join(lines) + "\n")
    return data


def until_step(proc, run_dir, step: int = 3, timeout: float = 300) -> None:
    """Until the live run has logged `step` (a `during` probe's first part)."""
    deadline = time.monotonic() + timeout
    while not any(r["step"] >= step for r in harness.rows_so_far(run_dir)):
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before step {step}"
        assert time.monotonic() < deadline, f"the run never reached step {step}"
        time.sleep(0.05)


def latest_checkpoint_step(run) -> int:
    names = [n for n in os.listdir(run / "checkpoints") if n.startswith("step_")
             and os.path.exists(run / "checkpoints" / n / "megarl.json")]
    return max(int(n.split("_")[1]) for n in names)


def resume_and_check(run_dir, data, *overrides: str, env=None) -> None:
    """After run 1 was stopped: keeps its rows and the generations up to its latest checkpoint
    (the rest rolled back), moves both logs aside, runs the same command again, which resumes
    from the checkpoint and finishes, and checks every prompt exactly once over both runs."""
    saved = latest_checkpoint_step(run_dir)
    assert saved >= 2
    rows1 = harness.rows_so_far(run_dir)
    gens1 = [g for g in harness.rows_so_far(run_dir, "generations.jsonl") if g["step"] <= saved]
    os.rename(run_dir / "generations.jsonl", run_dir.parent / "generations_run1.jsonl")
    os.rename(run_dir / "metrics.jsonl", run_dir.parent / "metrics_run1.jsonl")
    done = harness.train(run_dir, *overrides, data=data, env=env, check=True)
    assert [r["step"] for r in done.rows] == list(range(saved + 1, 10))
    check_exactly_once(gens1 + done.generations, rows1 + done.rows)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_sigkill_and_resume_trains_every_prompt_exactly_once(tmp_path, placement):
    data, run_dir = prompts(tmp_path), tmp_path / "run"
    args = (*OVERRIDES, *PLACEMENTS[placement])

    def sigkill_at_step_3(proc):  # the trainer with its local server: the whole process group
        until_step(proc, run_dir)
        os.killpg(proc.pid, signal.SIGKILL)

    harness.train(run_dir, *args, data=data, during=sigkill_at_step_3, start_new_session=True)
    resume_and_check(run_dir, data, *args)


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
