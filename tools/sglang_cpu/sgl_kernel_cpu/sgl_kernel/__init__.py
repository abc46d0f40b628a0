"""A stand-in for SGLang's `sgl_kernel` package so real SGLang runs on a CPU-only machine.

The PyPI kernel wheel holds CUDA kernels only; SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``)
imports a handful of names from it at module level. This package, put first on ``PYTHONPATH``,
provides plain-torch versions of exactly those; anything else raises ImportError on import, which
SGLang treats as "kernel not available" and falls back to its native torch paths.

It registers no ``torch.ops.sgl_kernel`` operators, so SGLang's Intel AMX backend stays off.
Importing it also applies two fixes to SGLang's CPU path, each to the modules that pin host
memory through CUDA: `_host_memory` (the routed-experts buffer of ``--enable-return-routed-experts``)
and `_lora_cpu` (the index tensors of ``--enable-lora``).
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from ._host_memory import install as _install_host_memory_fix
from ._lora_cpu import install as _install_lora_fix

__version__ = "0.0.0+megarl.cpu"
_install_host_memory_fix()
_install_lora_fix()


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """For each request i: ``req_to_token[req_pool_indices[i], start[i]:end[i]]`` takes the next
    ``end[i] - start[i]`` entries of ``out_cache_loc`` (requests laid out back to back)."""
    del pool_len  # the row length of req_to_token; slicing needs no explicit bound
    starts, ends = start_offset.tolist(), end_offset.tolist()
    rows = req_pool_indices.tolist()
    pos = 0
    for row, s, e in zip(rows, starts, ends):
        n = e - s
        if n > 0:
            req_to_token[row, s:e] = out_cache_loc[pos:pos + n].to(req_to_token.dtype)
        pos += n


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor,
                                tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """In each KV buffer (base address ``data_ptrs[b]``, row size ``strides[b]`` bytes) copy row
    ``src_loc[i]`` to row ``tgt_loc[i]``. All sources are read before any target is written, so
    overlapping moves are safe (as in the CUDA kernel)."""
    src, tgt = src_loc.tolist(), tgt_loc.tolist()
    for base, row_bytes in zip(data_ptrs.tolist(), strides.tolist()):
        rows = [ctypes.string_at(base + s * row_bytes, row_bytes) for s in src]
        for t, row in zip(tgt, rows):
            ctypes.memmove(base + t * row_bytes, row, row_bytes)


def _act_and_mul(act, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``act(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2``, written into ``out``."""
    d = x.shape[-1] // 2
    y = act(x[..., :d]) * x[..., d:]
    if out is None:
        return y
    out.copy_(y)
    return out


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return _act_and_mul(F.silu, input, out)


def gelu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return _act_and_mul(F.gelu, input, out)


def gelu_tanh_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return _act_and_mul(lambda t: F.gelu(t, approximate="tanh"), input, out)


def _speculative_only(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: speculative decoding is not supported by "
                                  "megarl's CPU stand-in kernels")

    kernel.__name__ = name
    return kernel


# Imported at module level by SGLang's speculative-decoding code, called only when it is enabled.
for _name in ("assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",
              "build_tree_kernel_efficient_cpu", "fill_accept_out_cache_loc_cpu",
              "fill_bonus_tokens_cpu", "verify_tree_greedy_cpu", "rotate_input_ids_cpu"):
    globals()[_name] = _speculative_only(_name)
del _name
