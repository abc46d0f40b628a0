"""LoRA adapters on SGLang: every push writes them as a PEFT directory that each server loads
(``/load_lora_adapter``) under the version's name; the buckets carry the base rows only.

Whether a run delivers adapters this way is its wire plan's ``adapters: peft``
(`megarl.protocol.wire_plan.WirePlan`), which the rollout manager reads too."""
from __future__ import annotations

import logging
import os
import shutil
from typing import Callable, Optional

from megarl.protocol.messages import LoadLoRA, UnloadLoRA
from megarl.weights.transports import PushError

log = logging.getLogger("megarl.push")


class AdapterDelivery:
    """The driver's record of which versions' adapters the servers hold, and the push step that
    writes and loads the next one."""

    def __init__(self, run_dir: str):
        self.dir = os.path.join(run_dir, "lora_adapters")
        self.loaded: list[int] = []  # driver: the versions whose adapters the servers hold

    def deliver(self, version: int, engine, dtype, driver: bool, admin, agree: Callable) -> int:
        """The adapters as ``<run_dir>/lora_adapters/v<version>`` (collective; global rank 0 writes
        it, so the servers must see the trainer's run directory: local servers, or a shared
        filesystem), loaded by every server as `policy_adapter` (version) - the name the rollout
        manager's requests carry once the push is published. The previous version's adapter is
        unloaded and its directory removed: the pause (weights.pause_mode abort) returned every
        request that used it. A re-push of the same version (a server rejoined) unloads and loads
        it again everywhere. Returns the adapters' bytes on rank 0 (0 elsewhere)."""
        from megarl.models.lora import export_peft
        from megarl.protocol.wire import policy_adapter

        path = os.path.join(self.dir, f"v{version}")
        nbytes = export_peft(engine.chunks, engine.args, engine.ps, engine.spec.lora, path, dtype=dtype)
        err: Optional[PushError] = None
        if driver:
            try:
                if version in self.loaded:  # a re-push: a rejoined server lacks it, the others hold it
                    try:
                        admin.request(UnloadLoRA(policy_adapter(version)))
                    except Exception as e:  # noqa: BLE001 - the servers that do not hold it say so
                        log.info("re-push of %s: %s", policy_adapter(version), e)
                admin.request(LoadLoRA(policy_adapter(version), os.path.abspath(path)))
                for old in [v for v in self.loaded if v != version]:
                    admin.request(UnloadLoRA(policy_adapter(old)))
                    shutil.rmtree(os.path.join(self.dir, f"v{old}"), ignore_errors=True)
                self.loaded = [version]
            except Exception as e:  # noqa: BLE001 - agreed below, so every rank raises
                err = PushError(f"/load_lora_adapter {policy_adapter(version)}: {e}")
        agree(err)
        return nbytes


def stage_adapter_bytes(engine, streams_buckets: bool, dtype) -> int:
    """LoRA pushed in the buckets: this stage's adapters in the serving dtype, from their shapes
    (stage sources only; 0 without LoRA)."""
    from megarl.models.lora import adapter_bytes, stage_layers

    lora = getattr(engine.spec, "lora", None)
    if lora is None or not engine.ps.is_pp_source or not streams_buckets:
        return 0
    return adapter_bytes(engine.args, lora.target_modules, lora.rank, stage_layers(engine.chunks), dtype)
