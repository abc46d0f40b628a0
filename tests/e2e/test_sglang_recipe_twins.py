"""Every shipped recipe that trains against SGLang, as a tiny twin against real SGLang (0.5.23,
CPU, fp32; `sglang` marker): the recipe file itself with only what this machine cannot do swapped
(`twin_overrides`: the tiny model, data and task reward, fp32, the local layer spec, gloo, one local
SGLang server the job starts instead of the cluster's, a few short steps), so every feature the
recipe turns on - asynchronous staleness and partial rollouts, its pause mode, tensor parallelism,
the distributed optimizer, recomputation, vocabulary padding, its loss, the weight wire chosen
against SGLang - runs as shipped. The mismatch gate (1e-5 nats, fp32) checks the trainer against
SGLang on the step-1 tokens. A recipe added to configs/ gets its twin by being there.

The MoE recipe's twin (asynchronous routing replay) is tests/e2e/test_sglang_moe.py's 20-step run;
megarl-server recipes (the tiny ones) are tests/e2e/test_recipes_learn.py's rows.
"""
import glob
import os

import pytest
from sglang_runs import DEMO, demo_model, require_sglang, train

from megarl.config import load_config

pytestmark = pytest.mark.sglang

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GAP = 1e-5
MOE_TWIN = "tests/e2e/test_sglang_moe.py::test_async_moe_replay_passes_the_gate_every_step"


def sglang_recipes() -> list[str]:
    """The recipes whose rollout servers are SGLang: a GPU recipe (TE spec) naming its servers."""
    out = []
    for path in sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml"))):
        cfg = load_config(path, ["model.hf_path=unused"], validate=False)
        if cfg.train.algorithm != "sft" and (cfg.rollout.engine == "sglang" or cfg.model.spec == "te"):
            out.append(os.path.basename(path))
    return out


def twin_overrides(recipe: str) -> list[str]:
    """What the tiny twin changes: only what a 2-core CPU machine cannot run or hold."""
    cfg = load_config(os.path.join(REPO, "configs", recipe), ["model.hf_path=unused"], validate=False)
    ranks = cfg.parallel.model_parallel  # data parallelism dropped: one replica (tp x pp x cp ranks)
    per_mini = max(1, cfg.train.global_batch_size // cfg.train.ppo_mini_batch_size)
    return ["model.dtype=float32", "model.spec=local", "parallel.backend=gloo", f"parallel.world_size={ranks}",
            "weights.dtype=float32", "weights.master_address=127.0.0.1", "weights.bucket_mb=16",
            "rollout.servers=[]", "rollout.local_servers=1", "rollout.max_new_tokens=8", "rollout.max_concurrent=32",
            "rollout.eval_at_start=false", "rollout.reward_fn=megarl.rewards:arith_exact_match",
            "train.steps=3", "train.global_batch_size=32", f"train.ppo_mini_batch_size={32 // min(per_mini, 4)}",
            "train.micro_batch_tokens=4096", "train.max_seq_len=32", f"train.mismatch_threshold={GAP}",
            "checkpoint.save_interval=0", "checkpoint.hf_export_interval=0", "data.eval_path="]


def test_every_sglang_recipe_has_a_twin():
    """The list the twins come from: the GPU recipes, the MoE one covered by its own test."""
    assert sglang_recipes() == ["qwen2.5-1.5b-gsm8k.yaml", "qwen2.5-7b-gsm8k.yaml", "qwen2.5-7b-long-reasoning.yaml",
                                "qwen3-30b-a3b-gsm8k.yaml"]


@pytest.mark.parametrize("recipe", [r for r in sglang_recipes() if "a3b" not in r])  # MoE: MOE_TWIN
def test_recipe_twin_runs_against_sglang_with_the_gate(tmp_path, recipe):
    require_sglang()
    model, run = demo_model(str(tmp_path / "model"), DEMO), str(tmp_path / "run")
    shipped = load_config(os.path.join(REPO, "configs", recipe), ["model.hf_path=unused"], validate=False)
    done = train(run, model, *twin_overrides(recipe), recipe=recipe)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]  # the gate stops a failing run
    rows = done.rows
    print(f"\n[twin {recipe}] " + "; ".join(f"{r['step']}: mismatch mean {r['mismatch/mean']:.2g} max "
                                           f"{r['mismatch/max']:.2g} on-policy {r['mismatch/onpolicy_frac']:.2f}"
                                           for r in rows))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["mismatch/onpolicy_frac"] == 1.0 and 0 < rows[0]["mismatch/mean"] <= GAP
    assert all(r["mismatch/mean"] <= GAP for r in rows)
    used = load_config(os.path.join(run, "config.yaml"), validate=False)  # what the run resolved and saved
    assert used.parallel.tp == shipped.parallel.tp and used.rollout.max_staleness == shipped.rollout.max_staleness
    assert used.parallel.cp == shipped.parallel.cp and used.checkpoint.async_save == shipped.checkpoint.async_save
    assert used.algo == shipped.algo and used.weights.transport == shipped.weights.transport
    assert used.weights.tensor_format == "sglang"  # the wire preflight chose against SGLang
