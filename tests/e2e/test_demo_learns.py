"""The demo recipe learns: a shortened `megarl-train configs/tiny_grpo.yaml` (same model, same
hyperparameters, fewer steps) raises held-out greedy accuracy clearly above its start, measured in
the run itself (rollout.eval_at_start logs the start as step 0), and writes the learning-curve PNG.
No timing assertions: the machine is shared."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_demo_recipe_raises_held_out_accuracy(tmp_path):
    run = tmp_path / "run"
    steps = 60
    cmd = [sys.executable, "-m", "megarl.train", os.path.join(REPO, "configs", "tiny_grpo.yaml"),
           f"model.hf_path={REPO}/examples/tiny/model",
           f"data.train_path={REPO}/examples/tiny/data/rl_prompts.jsonl",
           f"data.eval_path={REPO}/examples/tiny/data/eval_prompts.jsonl",
           f"train.run_dir={run}", "checkpoint.hf_export_dir=", f"train.steps={steps}",
           f"rollout.eval_interval={steps}", "rollout.eval_size=500", "rollout.eval_at_start=true"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=str(tmp_path),
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval_accuracy"] for r in rows if "eval_accuracy" in r}
    assert sorted(evals) == [0, steps], evals
    # 500 held-out prompts: the standard error of one accuracy is <= 0.023, so +0.08 is a real rise
    assert evals[steps] >= evals[0] + 0.08, evals
    assert 0.15 <= evals[0] <= 0.45, evals  # the demo start point (examples/tiny/sft_eval.json)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (run / "learning_curve.png").stat().st_size > 1000
