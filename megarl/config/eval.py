"""The `eval.*` section: what `megarl-eval` scores and where it writes (megarl/eval.py). The
held-out set, its size and k are the run's own evaluation settings (data.eval_path,
rollout.eval_size, rollout.eval_k), so a training run and megarl-eval measure the same thing."""
from __future__ import annotations

from dataclasses import dataclass

from megarl.config.common import _check
from megarl.common.fields import bounded


@dataclass
class EvalConfig:
    checkpoint: str = ""
    """megarl-eval: the Megatron checkpoint to score - a checkpoint directory, a save directory
    (its latest complete checkpoint), or latest (the latest in checkpoint.save_dir, by default
    <train.run_dir>/checkpoints: the run's own). It is exported to HF in a temporary directory
    (megarl-convert mcore-to-hf) and served from there. Empty = the HF model in model.hf_path."""
    out_dir: str = ""
    """megarl-eval: where results.json (the numbers) and samples.jsonl (every episode) are written;
    empty = <train.run_dir>/eval. A relative path is under train.run_dir. Both files appear whole
    (written aside, then renamed) and replace those of an earlier evaluation."""
    n: int = bounded(0, ge=0)
    """megarl-eval: sampled episodes per prompt behind eval pass@k (unbiased estimator from n >= k
    samples, k = rollout.eval_k); 0 = k."""

    def validate(self) -> None:
        _check(self, "eval")
