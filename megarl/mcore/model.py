"""Where a parameter of a built GPTModel sits in the whole model: its decoder layer's global
number and, in an MoE layer, the global indices of this rank's experts.

Megatron names a chunk's parameters by *local* layer (``decoder.layers.<i>``, i from 0 on each
pipeline stage) and *local* expert; the HF weight table (`megarl.models.hf_io`) is keyed by global
ones. The layer modules carry both numbers, as instance attributes outside megatron-core's public
API, hence these pinned functions (pins.MODEL_PINS)."""
from __future__ import annotations


def global_layer_index(model, local_layer: int) -> int:
    """0-based global decoder layer of ``model.decoder.layers[local_layer]`` (the stage offset added)."""
    return model.decoder.layers[local_layer].layer_number - 1


def local_expert_indices(model, local_layer: int) -> list[int]:
    """Global indices of this expert-parallel rank's experts in that (MoE) layer, in local order."""
    return model.decoder.layers[local_layer].mlp.local_expert_indices
