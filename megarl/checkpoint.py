"""Training checkpoints and HF export (interim: HF export only; resumable state in progress)."""
from __future__ import annotations

import os


class CheckpointManager:
    def __init__(self, cfg, ps, engine):
        self.cfg, self.ps, self.engine = cfg, ps, engine
        self.state: dict = {}

    def register(self, name: str, obj) -> None:
        self.state[name] = obj

    def resume(self) -> int:
        return 0

    def maybe_save(self, step: int, last: bool = False) -> None:
        c = self.cfg.checkpoint
        if c.hf_export_dir and (last or (c.hf_export_interval and step % c.hf_export_interval == 0)):
            self.engine.export_hf(c.hf_export_dir)
