"""The HF export schedule: when a run writes its model in HF format (safetensors + config.json +
tokenizer, loadable by transformers and SGLang) to ``checkpoint.hf_export_dir``.

The export is the run's deliverable, not state the run resumes from, so it is scheduled by the
training loops next to ``CheckpointManager.maybe_save`` rather than inside the manager (which owns
resumable state only). The rule: every ``checkpoint.hf_export_interval`` steps when that is set,
and always at the last step; never when ``hf_export_dir`` is empty. Each export overwrites the
previous one, so the directory holds the newest model, unless the path contains ``{step}``
(e.g. ``runs/sft/exports/step_{step}``): then every export gets its own directory, which is how
tools/make_tiny_model.py picks an intermediate SFT checkpoint as the RL start point.

``maybe_export_hf`` is collective: every rank calls it at every step with the same arguments
(the export gathers TP shards and each pipeline stage writes its part), and the decision depends
on the config and step only, so all ranks agree without communicating.
"""
from __future__ import annotations


def hf_export_due(c, step: int, last: bool) -> bool:
    """Whether step ``step`` exports, for a ``CheckpointConfig`` ``c`` (pure: unit-tested)."""
    if not c.hf_export_dir:
        return False
    return last or bool(c.hf_export_interval and step % c.hf_export_interval == 0)


def maybe_export_hf(cfg, engine, step: int, last: bool = False) -> bool:
    """Writes the HF model to ``cfg.checkpoint.hf_export_dir`` when the schedule says so (collective);
    returns whether it did."""
    if not hf_export_due(cfg.checkpoint, step, last):
        return False
    engine.export_hf(export_dir(cfg.checkpoint.hf_export_dir, step))
    return True


def export_dir(template: str, step: int) -> str:
    """The export directory of ``step``: ``template`` with ``{step}`` replaced (if present)."""
    return template.replace("{step}", str(step))
