"""The LoRA recipe learns: a shortened `megarl-train configs/tiny_grpo_lora.yaml` (the SFT'd tiny
model frozen, rank-16 adapters on every linear layer, the recipe's hyperparameters, fewer steps)
raises held-out greedy exact-match accuracy clearly above its start, both measured in the run itself
(rollout.eval_at_start logs step 0, where B = 0 makes the policy the base model). The same run's
pushes after the first carry only the adapters, so the rise comes from them. No timing assertions:
the machine is shared."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = f"{REPO}/examples/tiny/model"
STEPS = 70
# 40 steps sat at the knee of the curve: 2 of ~12 runs there (one in a clean-clone CI run) ended at
# 0.306, while the others rose +0.09..+0.16; 70 steps are past it: +0.166, +0.180, +0.178 (28-31 s,
# quiet machine).
# held-out exact-match rise the run must reach. Measured in 40 steps on the 2-core machine shared with
# a CI run (load average 6-28; 27-43 s for the command): +0.128, +0.124, +0.126, +0.140, +0.114 (50 steps:
# +0.130); with optim.lr=1e-9 the same 40 steps give +0.000. Greedy evaluation of the same 500
# prompts at both ends: the rise is a paired difference, whose standard error is ~sqrt(flipped/500),
# ~0.016-0.02 when 13-20% of answers flip, so 0.06 sits ~3 standard errors from both 0 and +0.114
RISE = 0.06


def test_lora_recipe_raises_held_out_exact_match(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megarl.train", os.path.join(REPO, "configs", "tiny_grpo_lora.yaml"),
           f"model.hf_path={MODEL}", f"data.train_path={REPO}/examples/tiny/data/rl_prompts.jsonl",
           f"data.eval_path={REPO}/examples/tiny/data/eval_prompts.jsonl", f"train.run_dir={run}",
           "checkpoint.hf_export_dir=", "checkpoint.save_interval=0", f"train.steps={STEPS}",
           f"rollout.eval_interval={STEPS}", "rollout.eval_size=500", "rollout.eval_at_start=true"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval_accuracy"] for r in rows if "eval_accuracy" in r}
    assert sorted(evals) == [0, STEPS], evals
    print(f"\n[lora-recipe] held-out exact match {evals[0]:.3f} -> {evals[STEPS]:.3f} in {STEPS} steps")
    assert evals[STEPS] >= evals[0] + RISE, evals
    assert 0.15 <= evals[0] <= 0.45, evals  # the demo start point (examples/tiny/sft_eval.json)
    # only the adapters moved: every step's push is the adapters' size, a fraction of the model's
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    model_bytes = os.path.getsize(f"{MODEL}/model.safetensors")
    for r in steps:
        assert r["push/bytes"] == r["push/adapter_bytes"] < model_bytes / 4, r
        assert r["optimizer_steps"] == 1 and r["grad_norm"] > 0, r
