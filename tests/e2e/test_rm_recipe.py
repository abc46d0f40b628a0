"""The reward-model recipe's preflight: a bad reward.model.path stops megarl-train before anything
starts, with one line naming the field. (The recipe learning, with its reward server killed once
mid-run, is the "rm" row of test_recipes_learn.py.)"""
import harness


def test_bad_reward_model_path_fails_at_preflight(tmp_path):
    run = harness.train(tmp_path / "run", f"reward.model.path={harness.TINY / 'model'}",
                        "checkpoint.save_interval=0", recipe="tiny_grpo_rm.yaml",
                        eval_data=harness.TINY / "data" / "eval_prompts.jsonl", timeout=120)
    assert run.returncode != 0
    lines = [ln for ln in run.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "reward.model.path" in lines[0] and "not a reward model" in lines[0], run.stderr
