"""megarl-server's command-line flags as SGLang's, for ``rollout.engine: sglang``: checked when the
config loads (`RolloutConfig.validate`) and applied when the manager starts SGLang's local servers
(`megarl.rollout.sglang_local`). Here, in the config package, so that loading a config imports
nothing of the rollout manager."""
from __future__ import annotations

from typing import Sequence

from megarl.common.errors import ConfigError

# megarl-server flags (python -m megarl.server --help) and what SGLang calls them.
RENAMED_FLAGS = {"--seed": "--random-seed", "--tp": "--tp-size"}
MEGARL_ONLY_FLAGS = {
    "--threads": "use rollout.server_threads (SGLang's servers get it as OMP_NUM_THREADS)",
    "--weights-root": "SGLang reads /update_weights_from_disk paths without a root list",
    "--weight-version": "SGLang starts at weight_version 'default'",
    "--tp-rank": "SGLang starts its TP ranks itself (--tp-size)",
    "--tp-port": "SGLang starts its TP ranks itself (--tp-size)",
}
JOB_FLAGS = ("--model", "--model-path", "--host", "--port")  # set by the job for each server


def sglang_flags(flags: Sequence) -> list[str]:
    """megarl-server flags of the local servers (rollout.server_args, route flags) as SGLang's:
    renamed where SGLang has the same option under another name, passed through when SGLang has
    it under the same name, and refused (ConfigError, one line) when it is megarl-server's own."""
    out = []
    for f in map(str, flags):
        name = f.split("=", 1)[0]
        if name in MEGARL_ONLY_FLAGS:
            raise ConfigError(f"rollout.server_args: {name} is a megarl-server flag that SGLang "
                              f"(rollout.engine=sglang) has not: {MEGARL_ONLY_FLAGS[name]}")
        if name in JOB_FLAGS:
            raise ConfigError(f"rollout.server_args: {name} is set by the job for each local server")
        out.append(RENAMED_FLAGS[name] + f[len(name):] if name in RENAMED_FLAGS else f)
    return out


def feature_flags(cfg, engine: str, gpu: bool) -> list[str]:
    """What the run's features need of each inference server it trains against, decided here once
    for every place that starts one: the rollout manager's local servers, `megarl-launch`'s planned
    servers (``--dry-run`` prints them) and the colocated placement. ``engine``: "sglang" or
    "megarl"; ``gpu``: the servers have CUDA devices.

    ==========================================  ==============================================
    feature                                     flags
    ==========================================  ==============================================
    routing replay (moe.routing_replay=rollout)  --enable-return-routed-experts (both engines)
    LoRA (lora.enabled) on SGLang               --enable-lora --max-lora-rank R
                                                --max-loras-per-batch 2 --lora-target-modules ..
    colocated placement on GPU with SGLang      --enable-memory-saver
    ==========================================  ==============================================

    megarl-server takes LoRA as pushed adapter tensors (no flag) and sleeps without one. SGLang's
    memory saver hooks CUDA allocations: on CPU the flag would fail its start-up, and there is no
    device memory to give back (preflight refuses colocated SGLang without CUDA). megarl-eval
    needs none: it serves a merged model and replays nothing."""
    flags = ["--enable-return-routed-experts"] if cfg.moe.routing_replay == "rollout" else []
    if engine == "sglang" and cfg.lora.enabled:
        from megarl.config.lora import hf_target_modules

        # two adapters per batch: the resumed segments of one push and the next never mix, but a
        # server may still finish a batch of the old version while the new one loads
        flags += ["--enable-lora", "--max-lora-rank", str(cfg.lora.rank), "--max-loras-per-batch", "2",
                  "--lora-target-modules", *hf_target_modules(cfg.lora.target_modules)]
    if engine == "sglang" and gpu and cfg.rollout.placement == "colocated":
        flags += ["--enable-memory-saver"]
    return flags
