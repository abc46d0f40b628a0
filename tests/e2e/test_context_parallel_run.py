"""The demo recipe with context parallelism: `megarl-train configs/tiny_grpo.yaml parallel.cp=2`
starts two ranks (one replica, every sequence split over both), pushes the weights the CP ranks
train to its rollout server and trains. With generation on-policy (rollout.max_staleness=0) every
token of every step was sampled by the weights the trainer scores it with, so the train-rollout
mismatch gate measures the whole CP path - batch split, attention over the gathered keys, the
gathered logprobs, the push - at every step. The same run saves its checkpoints in the background
(checkpoint.async_save, every 2 steps): each is committed while the run goes on, the last one
before the run ends."""
import harness


def test_demo_with_cp2_passes_the_mismatch_gate_every_step(tmp_path):
    run = harness.train(tmp_path / "run", "parallel.cp=2", "train.steps=6", "rollout.max_staleness=0",
                        "checkpoint.async_save=true", "checkpoint.save_interval=2", check=True)
    rows = run.rows
    print("\n[cp2 demo] " + "; ".join(f"step {r['step']}: mismatch mean {r['mismatch/mean']:.2e} max "
                                      f"{r['mismatch/max']:.2e}" for r in rows))
    assert "2 rank(s)" in run.log
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for r in rows:
        assert r["mismatch/onpolicy_frac"] == 1.0  # every token gated
        assert r["mismatch/mean"] < 1e-5 and r["mismatch/max"] < 1e-3  # CP=1 runs measure ~1e-7 / ~1e-5
    assert rows[-1]["policy_version"] == 6
    for step in (2, 4, 6):
        assert f"checkpoints/step_{step:08d} in the background" in run.log
    assert sorted(p.name for p in (run.dir / "checkpoints").iterdir()) == ["latest", "step_00000004", "step_00000006"]
