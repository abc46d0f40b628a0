"""Swapping the LM head of a megatron-core `GPTModel` for another module (the critic's value head).

`GPTModel` has no public way to change its head: its ``output_layer`` attribute is called by
``_postprocess`` as ``output_layer(hidden_states, weight=..., runtime_gather_output=...)`` and
returns ``(output, bias)``; ``_postprocess`` also reads ``output_layer.sequence_parallel`` (to
gather sequence-parallel hidden states first), and ``share_embeddings_and_output_weights`` makes
it pass the input embedding's weight instead. Those contracts are pinned in
`megarl.mcore.pins.HEAD_PINS`.
"""
from __future__ import annotations

import torch

__all__ = ["replace_output_layer"]


def replace_output_layer(model, layer: torch.nn.Module) -> bool:
    """Puts ``layer`` in place of ``model.output_layer`` on the last pipeline stage and unties the
    head from the input embedding on every stage (the new head shares nothing with it). ``layer``
    takes ``(hidden_states, weight=None, runtime_gather_output=None)`` and returns ``(out, None)``;
    it sees the hidden states unscattered (``sequence_parallel`` False). Returns whether this chunk
    holds the head (``model.post_process``)."""
    model.share_embeddings_and_output_weights = False
    if not model.post_process:
        return False
    layer.sequence_parallel = False  # read by GPTModel._postprocess: no gather before the head
    model.output_layer = layer
    return True
