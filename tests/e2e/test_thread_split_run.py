"""train.torch_threads auto in a run whose trainer waits for generation: the demo, synchronous
(rollout.max_staleness=0), 64 answers of 24 tokens a step, so the trainer waits ~40% of each step
and the server idles during each update. Both phases' trials run (the update's first 8 steps,
then the wait's 8, each alternating one and two threads), the wait's through the rollout manager
to megarl-server's /set_threads, and every later step runs on what its window's medians chose."""
import harness

from megarl.trainer import threads as T


def test_a_waiting_trainer_lends_its_core_to_the_server_through_the_manager(tmp_path):
    run = harness.train(tmp_path / "run", "train.torch_threads=auto", "rollout.max_staleness=0",
                        "rollout.max_new_tokens=24", "rollout.ignore_eos=true", "train.global_batch_size=64",
                        f"train.steps={2 * T.TRIALS + 3}", "checkpoint.save_interval=0", "logging.log_interval=1",
                        check=True)
    rows = {r["step"]: r for r in run.rows}
    assert "no more lending" not in run.log  # every /set_threads the manager relayed was taken
    # the split's own step count starts at 0 with run step 1: the update's window is run steps
    # 1..8 (step 1 reads no idle share yet), the wait's 9..16
    update_window = range(2, T.TRIALS + 1)
    wait_window = range(T.TRIALS + 1, 2 * T.TRIALS + 1)
    for s in update_window:
        want = (1, 2)[(s - 1) % 2] if rows[s - 1].get("trainer/servers_idle", 0.0) >= T.BORROW_AT else 1
        assert rows[s]["trainer/update_threads"] == want, s
    lent = 0
    for s in wait_window:
        waited = rows[s - 1]["trainer/trainer_idle"]
        want = (1, 2)[(s - 1) % 2] if waited >= T.LEND_AT else 1
        assert rows[s]["trainer/wait_server_threads"] == want, (s, waited)
        lent += want == 2
    assert lent >= T.TRIALS // 2 - 1, [rows[s]["trainer/trainer_idle"] for s in wait_window]
    assert "server threads while the trainer waits 1 -> 2: the trainer waited" in run.log
    # after the windows: one choice per phase, the one printed with its measured costs
    after = [rows[s] for s in range(2 * T.TRIALS + 1, 2 * T.TRIALS + 4)]
    assert len({r["trainer/wait_server_threads"] for r in after}) == 1
    assert len({r["trainer/update_threads"] for r in after}) == 1
    # a window decides at its last step when that step was a trial (two threads): the wait's was
    assert rows[2 * T.TRIALS]["trainer/wait_server_threads"] == 2
    phases = [("the wait with the servers", "trainer/wait_server_threads")]
    if rows[T.TRIALS]["trainer/update_threads"] == 2:
        phases.append(("the update", "trainer/update_threads"))
    for what, key in phases:
        line = next(x for x in run.log.splitlines() if x.startswith(f"[megarl] trials of {what}: 1: "))
        assert line.endswith(f"-> {int(after[0][key])} thread(s)"), (line, after[0][key])
