"""HF config -> Megatron ``TransformerConfig`` + layer spec -> ``GPTModel`` chunks.

One model chunk per virtual pipeline stage (a single chunk without interleaving). On CPU the
local spec is the only choice: fp32, fusions off, CPU initialisation (which also makes the
initial weights independent of the TP layout: Megatron initialises the full master weight and
splits it). The vocabulary is padded (``ModelArgs.padded_vocab_size``) and the layers may split
unevenly over pipeline stages (:mod:`megarl.models.stages`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megarl.common import compat
from megarl.models import stages
from megarl.protocol.hf_model import ModelArgs


def cp_refusal(args: ModelArgs) -> Optional[str]:
    """Why this model cannot run with context parallelism (one line naming parallel.cp), or None."""
    if args.num_experts:
        return (f"parallel.cp: context parallelism is not supported for MoE models "
                f"({args.architecture} has {args.num_experts} experts); use parallel.cp=1")
    if args.sliding_window:
        return (f"parallel.cp: context parallelism is not supported with sliding-window "
                f"attention ({args.architecture}, window {args.sliding_window}); use parallel.cp=1")
    return None


def transformer_config(args: ModelArgs, *, tp: int, pp: int, vpp: Optional[int] = None,
                       first_stage_layers: Optional[int] = None,
                       last_stage_layers: Optional[int] = None, dtype: str = "float32",
                       sequence_parallel: bool = False, recompute: bool = False, use_te: bool = False,
                       ep: int = 1, moe=None, cp: int = 1, cp_comm_type: str = "p2p"):
    """The ``TransformerConfig`` for an HF architecture and a parallel layout. ``args`` carries the
    padded vocabulary (:func:`megarl.models.layouts.pad_vocab`); the pipeline split is resolved
    by :func:`megarl.models.stages.resolve` (uneven splits become explicit first/last counts);
    ``moe`` is the `megarl.config.moe.MoEConfig` (None: its defaults); ``cp`` the context-parallel
    size (``cp_comm_type``: how TE's attention exchanges K/V; the CPU attention all-gathers)."""
    from megatron.core.transformer import TransformerConfig

    if args.mcore_vocab_size % tp:
        raise ValueError(f"model.make_vocab_size_divisible_by: the Megatron vocabulary "
                         f"{args.mcore_vocab_size} is not divisible by parallel.tp={tp}")
    split = stages.resolve(args.num_layers, pp, vpp, first_stage_layers, last_stage_layers)
    bf16 = dtype == "bfloat16"
    if bf16 and not compat.HAVE_CUDA:
        raise ValueError("model.dtype: bfloat16 needs a GPU; use float32 on CPU")
    if sequence_parallel and not use_te:
        raise ValueError("parallel.sequence_parallel: needs the Transformer Engine spec (GPU)")
    params_dtype = torch.bfloat16 if bf16 else torch.float32
    extra = _optional_kwargs(args, recompute, tp, ep, moe, use_te, sequence_parallel, cp, cp_comm_type)
    extra.update(split.megatron_kwargs())
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_heads,
        num_query_groups=args.num_kv_heads,
        kv_channels=args.head_dim,
        ffn_hidden_size=args.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=args.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=args.qkv_bias,
        qk_layernorm=args.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=args.initializer_range,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=bf16,
        use_cpu_initialization=not compat.HAVE_CUDA,
        perform_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=use_te,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # Token-budget micro-batches have different lengths: shapes are sent before tensors. Not
        # with the interleaved schedule: megatron-core 0.16.1 batches a stage's sends and receives
        # in the order send-prev, recv-prev, send-next, recv-next, so at PP=2 (previous and next
        # stage the same rank) a forward and a backward message to one peer are received into each
        # other's buffers - the shapes exchanged first as well. Interleaved steps feed packed
        # micro-batches of one shape (the engine pads every pack to the step's longest), and the
        # unbatched p2p path, which sends the two directions over two process groups at PP=2.
        variable_seq_lengths=not vpp,
        batch_p2p_comm=not vpp,
        moe_token_dispatcher_type="alltoall",  # 0.16.1 requires it with variable_seq_lengths
        calculate_per_token_loss=True,
        deallocate_pipeline_outputs=False,
        **extra,
    )


def _optional_kwargs(args: ModelArgs, recompute: bool, tp: int, ep: int, moe, use_te: bool,
                     sequence_parallel: bool, cp: int, cp_comm_type: str) -> dict:
    """`transformer_config`'s settings that only some models and layouts have: recompute, the
    sliding window, MoE, context parallelism."""
    extra: dict = {}
    if recompute:
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if args.sliding_window:
        # HF: a token sees itself and the W-1 tokens before it; Megatron: window (left, right).
        # The local spec honours it in its unfused softmax (a [s, s] mask), TE in its kernels.
        extra["window_size"] = (args.sliding_window - 1, 0)
        if args.window_layers is not None:  # per-layer list: 1 = windowed (1-indexed by Megatron)
            extra["window_attn_skip_freq"] = [int(w) for w in args.window_layers]
    if args.num_experts:
        extra.update(moe_kwargs(args, tp, ep, moe, use_te=use_te, sequence_parallel=sequence_parallel))
    elif ep > 1:
        raise ValueError(f"parallel.ep: {ep} > 1 needs an MoE model ({args.architecture} is dense)")
    if cp > 1:
        refusal = cp_refusal(args)
        if refusal:
            raise ValueError(refusal)
        extra.update(context_parallel_size=cp, cp_comm_type=cp_comm_type)
    return extra


def moe_kwargs(args: ModelArgs, tp: int, ep: int, moe=None, use_te: bool = False,
               sequence_parallel: bool = False) -> dict:
    """TransformerConfig MoE fields matching HF Qwen3-MoE routing: softmax over the experts, top-k,
    renormalised when ``norm_topk_prob`` (Megatron: top-k on the logits, then softmax over the k =
    the same probabilities) else not (softmax first). Load-balancing loss and z-loss from ``moe``
    (`MoEConfig`; off by default: RL fine-tuning keeps the router as trained). Tokens move by
    all-to-all over the expert-parallel group. Experts are never split over TP
    (``expert_tensor_parallel_size=1``: the weight tables hold whole experts); on the TE spec they
    run as one grouped GEMM (TEGroupedMLP), on the local spec one after another (SequentialMLP)."""
    from megarl.config.moe import MoEConfig

    moe = moe or MoEConfig()
    if tp > 1 and not (use_te and sequence_parallel):
        # megatron-core 0.16.1 MoELayer.forward raises when training with TP > 1 and no sequence
        # parallelism; sequence parallelism needs the TE spec (builder: transformer_config).
        raise ValueError(f"parallel.tp: MoE models ({args.architecture}) with tp={tp} > 1 need "
                         f"parallel.sequence_parallel=true with the TE spec (model.spec=te, GPU); on "
                         f"CPU use tp=1 and expert parallelism (parallel.ep)")
    if args.num_experts % ep:
        raise ValueError(f"parallel.ep: {ep} does not divide num_experts={args.num_experts}")
    aux, z = moe.aux_loss_coeff, moe.z_loss_coeff
    return dict(num_moe_experts=args.num_experts, moe_router_topk=args.moe_topk,
                moe_ffn_hidden_size=args.moe_ffn_hidden_size, moe_router_pre_softmax=not args.moe_norm_topk,
                moe_router_score_function="softmax",
                moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
                moe_aux_loss_coeff=aux, moe_z_loss_coeff=z if z > 0 else None,  # None: not computed
                moe_router_dtype="fp32", moe_grouped_gemm=use_te,
                moe_permute_fusion=False, expert_model_parallel_size=ep,
                expert_tensor_parallel_size=1)


def layer_spec(args: ModelArgs, use_te: bool, attention: str = "sdpa"):
    """TE's layer spec, or the local one; the local spec's core attention is torch's fused SDPA
    (`megarl/mcore/sdpa.py`) unless ``attention="unfused"`` (Megatron's `DotProductAttention`)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    moe = dict(num_experts=args.num_experts, moe_grouped_gemm=use_te) if args.num_experts else {}
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_norm, **moe)
    spec = specs.get_gpt_layer_local_spec(qk_layernorm=args.qk_norm, normalization="RMSNorm", **moe)
    if attention == "sdpa":
        from megarl.mcore.sdpa import use_sdpa_core_attention

        spec = use_sdpa_core_attention(spec)
    return spec


def resolve_spec(spec: str) -> bool:
    """``model.spec`` -> use TE? (auto: TE exactly when TE and CUDA are both present)."""
    if spec == "te":
        if not compat.use_transformer_engine():
            raise ValueError("model.spec: 'te' needs transformer-engine and a CUDA device")
        return True
    if spec == "local":
        return False
    return compat.use_transformer_engine()


def gpt_model(args: ModelArgs, config, use_te: bool, vp_stage: Optional[int] = None,
              attention: str = "sdpa") -> torch.nn.Module:
    """One GPTModel chunk of this rank's pipeline stage (virtual stage ``vp_stage`` when
    interleaving), on the current default device; the one place the HF architecture's RoPE,
    tying and vocabulary reach Megatron's model."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(args, use_te, attention),
        vocab_size=args.mcore_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        parallel_output=True,
        share_embeddings_and_output_weights=args.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(args.rope_theta),
        rope_scaling=args.rope_scaling_factor is not None,
        rope_scaling_factor=args.rope_scaling_factor or 8.0,
        vp_stage=vp_stage,
    )


def build_model_chunks(args: ModelArgs, config, use_te: bool, attention: str = "sdpa") -> list[torch.nn.Module]:
    """GPTModel chunks for this rank's pipeline stage(s); the caller wraps them in DDP."""
    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        model = gpt_model(args, config, use_te, vp_stage if vpp else None, attention)
        if compat.HAVE_CUDA:
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks
