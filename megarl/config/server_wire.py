"""The weight wire chosen by the servers: `resolve_wire` turns ``weights.tensor_format: auto`` and
``weights.verify_interval: auto`` into what every server of the set can take, and refuses an
explicit setting that one of them cannot honour, naming the field and the server.

What a server can take is what it advertises (`megarl.protocol.wire.server_extensions` of its
``/model_info``): megarl-server lists its extensions to SGLang's protocol; real SGLang lists none
and gets SGLang's endpoints and load formats only.

    transport    tensor_format auto                          needs per server
    distributed  megarl (direct_bucket) when every server    megarl: direct_bucket; sglang: -
                 has it, else sglang (flattened_bucket,      (megarl-server takes SGLang's
                 which megarl-server takes too)              flattened buckets as well)
    tensor       megarl (safetensors) when every server      megarl: safetensors_b64; sglang:
                 has it, sglang when none has; a mixed set   none (megarl-server never
                 is refused                                  unpickles SGLang's payload)
    disk         megarl when every server has disk_delta,    weights.disk_delta != off: disk_delta
                 else sglang (both read HF checkpoints)

    verify_interval auto: AUTO_VERIFY_EVERY (10) when every server has weights_checksum, else 0;
    N > 0 needs weights_checksum everywhere. refit=shard needs shard_refit everywhere.
    pause_mode auto: abort for megarl-servers; retract with SGLang in the set (its abort pause
    waits out a 1 s poll), unless rollout.partial_rollout is false or lora.rank > 0 (abort).

Torch-free and numpy-free at import (a config module): `megarl.protocol.wire` is imported on first use.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from megarl.common.errors import ConfigError

# verify_interval auto: the checksums of every 10th push (versions 0, 10, 20, ...). Every step's
# train.mismatch_gate already compares the trainer's logprobs of the served tokens with the
# server's, so a push that changes what the server computes is caught at once; the checksums
# catch what logprobs cannot see (a tensor the sampled tokens barely touch) within 10 pushes, at
# a tenth of their cost on the trainer's critical path (~20 ms of a 0.35 s demo step checked
# every push; issue #29).
AUTO_VERIFY_EVERY = 10


def local_extensions(engine: str) -> frozenset:
    """What the servers a job starts itself advertise: megarl-server all of megarl's extensions,
    SGLang none."""
    from megarl.protocol.wire import MEGARL_EXTENSIONS

    return frozenset(MEGARL_EXTENSIONS) if engine == "megarl" else frozenset()


def required_extensions(weights) -> frozenset:
    """What a server must advertise to take the resolved ``weights`` wire: a server that comes
    back (restarted, or replaced at its address) is re-admitted only if it still does."""
    from megarl.protocol.wire import (EXT_CHECKSUM, EXT_DIRECT_BUCKET, EXT_DISK_DELTA, EXT_SAFETENSORS,
                                      EXT_SHARD_REFIT)

    from megarl.protocol.wire import EXT_SHARED_MEMORY

    need = set()
    if weights.transport == "shm":
        need.add(EXT_SHARED_MEMORY)
    elif weights.tensor_format == "megarl" and weights.transport != "disk":
        need.add(EXT_DIRECT_BUCKET if weights.transport == "distributed" else EXT_SAFETENSORS)
    if weights.verify_interval:
        need.add(EXT_CHECKSUM)
    if weights.refit == "shard":
        need.add(EXT_SHARD_REFIT)
    if weights.disk_delta != "off":
        need.add(EXT_DISK_DELTA)
    return frozenset(need)


def is_resolved(weights) -> bool:
    """No auto left in the fields `resolve_wire` decides (a config megarl-train saved)."""
    return "auto" not in (weights.tensor_format, weights.pause_mode) and weights.verify_interval is not None


def resolve_wire(weights, servers: Mapping[str, frozenset], partial_rollout: bool = True, lora: bool = False):
    """``weights`` (a `WeightSyncConfig`) with ``tensor_format``, ``verify_interval`` and
    ``pause_mode`` resolved for ``servers`` ({url: advertised extensions}); raises `ConfigError`
    naming the field and the first server that cannot take an explicit setting.
    ``partial_rollout`` (rollout.partial_rollout): false keeps requests from running across a
    push, so auto pauses by abort. ``lora`` (lora.rank > 0): SGLang servers take the adapters
    through /load_lora_adapter, a set of SGLang and megarl-servers is refused, and auto pauses by
    abort (a retracted request would resume on the previous adapter)."""
    from megarl.protocol.wire import (EXT_CHECKSUM, EXT_DIRECT_BUCKET, EXT_DISK_DELTA, EXT_SAFETENSORS,
                                      EXT_SHARD_REFIT)

    if not servers:
        return weights
    # a server that advertises nothing is SGLang (megarl-server advertises its extensions)
    plain = [url for url, got in servers.items() if not got]

    def lacking(ext: str) -> list[str]:
        return [url for url, got in servers.items() if ext not in got]

    def require(ext: str, field: str, setting: str, instead: str) -> None:
        missing = lacking(ext)
        if missing:
            raise ConfigError(f"{field}: {setting} needs the megarl-server extension {ext}, which "
                              f"server {missing[0]} does not advertise (SGLang's protocol only); {instead}")

    from megarl.protocol.wire import EXT_SHARED_MEMORY

    fmt = weights.tensor_format
    payload = {"distributed": EXT_DIRECT_BUCKET, "tensor": EXT_SAFETENSORS, "disk": EXT_DISK_DELTA,
               "shm": EXT_SHARED_MEMORY}[weights.transport]
    if weights.transport == "shm":
        require(EXT_SHARED_MEMORY, "weights.transport", "shm", "use weights.transport=distributed")

    if weights.transport == "tensor":
        with_ext = [u for u in servers if u not in lacking(payload)]
        if fmt == "auto" and with_ext and len(with_ext) < len(servers):
            raise ConfigError(f"weights.transport: tensor payloads differ across the servers: "
                              f"{with_ext[0]} takes megarl's, {lacking(payload)[0]} only SGLang's; "
                              "a mixed server set needs weights.transport=distributed or disk")
        if fmt == "sglang" and with_ext:
            raise ConfigError(f"weights.tensor_format: sglang over weights.transport=tensor sends pickled "
                              f"tensor payloads, which megarl-server {with_ext[0]} refuses; leave it auto "
                              "or set megarl")
    if fmt == "auto":
        fmt = "sglang" if lacking(payload) else "megarl"
    elif fmt == "megarl" and weights.transport != "disk":
        require(payload, "weights.tensor_format", "megarl", "leave it auto or set sglang")
    if lora and fmt == "sglang" and not plain:
        raise ConfigError(f"weights.tensor_format: sglang with lora.rank > 0 loads the adapters by "
                          f"/load_lora_adapter and names them in every request, which megarl-server "
                          f"{next(iter(servers))} does not serve (it merges pushed adapters); leave it auto")
    if weights.refit == "shard":
        require(EXT_SHARD_REFIT, "weights.refit", "shard", "use weights.refit=gather")
    if weights.disk_delta != "off":
        require(EXT_DISK_DELTA, "weights.disk_delta", weights.disk_delta, "set it to off")

    if lora and plain and len(plain) < len(servers):
        megarl = next(u for u in servers if u not in plain)
        raise ConfigError(f"rollout.servers: lora.rank > 0 loads PEFT adapters into SGLang ({plain[0]}) but "
                          f"pushes adapter tensors to megarl-server ({megarl}); use one kind of server")
    pause = weights.pause_mode
    if pause == "auto":
        # SGLang's abort pause polls every 1 s until its requests let go; retract answers at once
        pause = "retract" if plain and partial_rollout and not lora else "abort"
    if pause == "in_place" and weights.transport == "disk":
        if plain:
            raise ConfigError(f"weights.pause_mode: in_place keeps paused requests running on their cache, "
                              f"and SGLang's /update_weights_from_disk (weights.transport=disk) refuses "
                              f"to load under them (server {plain[0]}); use transport distributed or "
                              "tensor, or pause_mode abort or retract")

    verify = weights.verify_interval
    if verify is None:
        verify = 0 if lacking(EXT_CHECKSUM) else AUTO_VERIFY_EVERY
    elif verify > 0:
        require(EXT_CHECKSUM, "weights.verify_interval", str(verify), "set it to 0 or auto")
    resolved = dataclasses.replace(weights, tensor_format=fmt, verify_interval=verify, pause_mode=pause)
    resolved.validate()
    return resolved
