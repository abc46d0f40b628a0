"""Every use of megatron-core internals, in one pinned package.

megarl is written against megatron-core ``SUPPORTED_MCORE_VERSION``. The rest of megarl uses only
megatron-core's public API (``pins.PUBLIC_MODULES``) plus the functions here, which are named for what
megarl needs:

    pins.py        the table of every private or deep megatron-core name used (module, kind,
                   recorded call signature, user, why) and the check the pin test runs
    cpu.py         install_cpu_shim: megatron-core on CPU (torch.cuda redirected, RNG and MoE
                   helpers replaced, the all-to-all backward run under the CPU mode)
    sdpa.py        SDPAttention / use_sdpa_core_attention: torch's fused attention inside
                   Megatron's DotProductAttention (the local spec's core attention)
    optimizer.py   step_unless_nonfinite: Megatron's optimizer step from its parts, skipping a
                   non-finite gradient norm
    routing_replay.py  RoutingReplay: MoE routers take the rollout engine's expert ids and weights
    moe.py         the router losses: per-step coefficients on the config, the per-layer tracker
    model.py       global_layer_index / local_expert_indices: a parameter's layer and experts in the
                   whole model (the HF weight table is keyed by them)
    heads.py       replace_output_layer: another module (the critic's value head) in place of
                   GPTModel's LM head
    checkpoint.py  the torch_dist save strategy, sharded state dicts, loads with one-line errors,
                   the optimizer-load fixes, stacked_piece (one layer of a stacked checkpoint key)

Upgrading megatron-core: docs/architecture.md ("Upgrading megatron-core") lists what to re-check.
Nothing here imports megatron-core at module import time.
"""
from megarl.mcore.pins import SUPPORTED_MCORE_VERSION

__all__ = ["SUPPORTED_MCORE_VERSION"]
