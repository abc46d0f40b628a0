"""Per-rank RNG state (python, numpy, torch CPU/CUDA, Megatron's model-parallel RNG tracker) as
one safetensors file, so that a resumed run draws the same random numbers (dropout, sampling) as
an uninterrupted one.

safetensors rather than ``torch.save``: loading must never unpickle (see ``safe.py``). Tensor
states are tensors; python's and numpy's states are JSON in the file's string metadata. The
states are only meaningful for the layout that saved them (each rank has its own), so the
manager restores them only when the TP/PP/DP layout is unchanged.
"""
from __future__ import annotations

import json
import random

import numpy as np
import torch


def save_rng(path: str) -> None:
    """Writes this rank's RNG states to ``path``."""
    from megatron.core import tensor_parallel
    from safetensors.torch import save_file

    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state().cpu()
    for name, st in tensor_parallel.get_cuda_rng_tracker().get_states().items():
        tensors[f"tracker.{name}"] = st.cpu()
    np_state = np.random.get_state()
    meta = {"python": json.dumps(random.getstate()),
            "numpy": json.dumps([np_state[0], np_state[1].tolist(), *np_state[2:]])}
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=meta)


def load_rng(path: str) -> None:
    """Restores this rank's RNG states from ``path`` (written by ``save_rng``)."""
    from megatron.core import tensor_parallel
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])
    tracker = {k[len("tracker."):]: v for k, v in tensors.items() if k.startswith("tracker.")}
    if tracker:
        tensor_parallel.get_cuda_rng_tracker().set_states(tracker)
    # JSON turned python's state tuple and numpy's key array into lists: rebuild the exact types
    version, internal, gauss = json.loads(meta["python"])
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = json.loads(meta["numpy"])
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
