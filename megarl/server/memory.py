"""Sleep and wake: SGLang's ``/release_memory_occupation`` and ``/resume_memory_occupation``.

    {"tags": ["kv_cache", "weights"]}      tags null or [] = all of them

A colocated trainer (`rollout.placement: colocated`) puts the server to sleep while it trains and
wakes it before the next push, so the two never hold their working memory at once (seed 004's
hybrid engine). SGLang frees GPU memory through torch_memory_saver; here the memory is host RAM:

- ``kv_cache``: the cache's tensors are dropped (it grows again on the next prefill);
- ``weights``: every parameter storage is resized to 0 bytes (the tensors, their views - fused QKV
  and gate/up rows - and their shapes stay), and on resume reallocated and zero-filled. Like
  SGLang's (without a CPU backup), resumed weights hold nothing until a weight update loads them:
  until every parameter was loaded again the engine generates nothing (requests queue), so a
  partial push (``weights.delta``, frozen tensors) can never generate from zeros.
- ``cuda_graph``: accepted, nothing to release (megarl-server captures no CUDA graphs).

On a GPU (``--device cuda``) the same resize frees the parameters' device memory and
``torch.cuda.empty_cache`` hands it back to the driver (tests/gpu/test_gpu_colocated.py).

After the tensors are gone ``malloc_trim`` hands freed heap pages back to the kernel (glibc keeps
them otherwise), so the process's resident memory falls by what was released. As in SGLang the
server must be idle to release (no request running or queued, unless generation is paused).
Under ``--tp N`` only ``kv_cache`` is released (the followers mirror the cache clear; their
parameter storages are their own).
"""
from __future__ import annotations

import ctypes
import torch

KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
TAGS = (WEIGHTS, KV_CACHE, CUDA_GRAPH)


class MemoryError_(ValueError):
    """A release or resume that cannot be done (the message names why); HTTP 400."""


def parse_tags(tags) -> list[str]:
    if tags is None or tags == []:
        return list(TAGS)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise MemoryError_(f"tags: expected a list of strings, got {tags!r}")
    bad = [t for t in tags if t not in TAGS]
    if bad:
        raise MemoryError_(f"tags: unknown {bad} (known: {', '.join(TAGS)})")
    return list(dict.fromkeys(tags))


def release(engine, tags: list[str]) -> dict:
    """Engine thread. Frees the tagged memory; returns {"released": tags, "freed_bytes": n}."""
    again = [t for t in tags if t in engine.released]
    if again:
        raise MemoryError_(f"tags: {again} already released")
    # queued requests are fine while paused or already asleep: they wait for the wake
    if engine.running or (engine.waiting and not engine.paused and not engine.released):
        raise MemoryError_("release_memory_occupation should be called only when the server is idle "
                           f"({len(engine.running)} running, {len(engine.waiting)} queued)")
    model, freed = engine.model, 0
    if WEIGHTS in tags and model.tp is not None:
        raise MemoryError_("tags: weights cannot be released on a --tp server (kv_cache can)")
    if KV_CACHE in tags:
        freed += sum(t.numel() * t.element_size() for t in engine.cache.k + engine.cache.v)
        engine.cache.clear()
    if WEIGHTS in tags:
        engine.weight_storages = [(s, s.nbytes()) for s in _storages(model)]
        for storage, nbytes in engine.weight_storages:
            freed += nbytes
            storage.resize_(0)
        engine.unloaded = set(model.params)
    engine.released.update(tags)
    _trim()  # the tensors went with their last reference; no gc pass (~0.1 s in a big process)
    return {"released": tags, "freed_bytes": freed}


def resume(engine, tags: list[str]) -> dict:
    """Engine thread. Gives the tagged memory back (weights zero-filled, awaiting a load)."""
    missing = [t for t in tags if t not in engine.released]
    if missing:
        raise MemoryError_(f"tags: {missing} not released")
    if WEIGHTS in tags:
        for storage, nbytes in engine.weight_storages:
            storage.resize_(nbytes)
            torch.empty(0, dtype=torch.uint8).set_(storage).zero_()
        engine.weight_storages = []
    engine.released.difference_update(tags)
    return {"resumed": tags, "awaiting_weights": len(engine.unloaded)}


def _storages(model) -> list:
    """Each parameter storage once: the views of one fused row (QKV, gate/up) share one."""
    seen, out = set(), []
    for name, t in model.params.items():
        s = t.untyped_storage()
        if not s.resizable():
            raise MemoryError_(f"tags: weights: {name}'s memory cannot be released (not resizable)")
        if s.data_ptr() not in seen and s.nbytes():
            seen.add(s.data_ptr())
            out.append(s)
    return out


def _trim() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # the caching allocator's freed blocks back to the driver
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def canonical(model, names) -> set[str]:
    """Parameter keys written by a load of HF tensors ``names`` (a tied lm_head is the embedding)."""
    out = set()
    for n in names:
        if n == "lm_head.weight" and model.cfg.tie_word_embeddings:
            n = "model.embed_tokens.weight"
        out.add(n)
    return out
