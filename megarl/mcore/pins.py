"""The table of every private or deep megatron-core name megarl uses, and the check behind the pin test.

megarl is written against one megatron-core release (``SUPPORTED_MCORE_VERSION``). Everything it
needs from megatron-core beyond the public surface (the package ``__init__``s and the modules
Megatron's own quickstart imports, ``PUBLIC_MODULES``) is listed in ``PINS``, one `Pin` per name,
with the file of ``megarl/mcore/`` that uses it and why. ``tests/dist/test_mcore_pins.py`` resolves
each entry in the installed megatron-core and fails naming it when it is gone or its call signature
changed; ``tests/unit/test_mcore_guard.py`` fails when a module outside ``megarl/mcore/`` reaches
past ``PUBLIC_MODULES``, imports a private name or patches a megatron-core attribute.
docs/architecture.md renders the table (:func:`markdown_table`).

Kinds of entry:

* ``call``: a function, method or class whose call signature (parameter names, kinds and
  defaults; not annotations, whose rendering changes with the Python version) is recorded.
* ``attr``: a name that must exist (an enum, a class attribute, a property, a module global).
* ``self``: an attribute a class sets on its instances in ``__init__`` (``self.x = ...``), so only
  the class source shows it still exists.
* ``source``: text megatron-core's source must still contain. Without ``text``: a module global
  read by megatron-core that may be absent at run time (defined only when Transformer Engine
  imports); the module source must still mention it. With ``text``: a line of behaviour megarl
  relies on that no name shows (the router reading a config coefficient at each forward, the keys
  of a dict it fills); the source of the function or class ``qualname`` must contain ``text``.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Optional

SUPPORTED_MCORE_VERSION = "0.16.1"

# megatron-core modules the rest of megarl may import from: package __init__s (their names are
# megatron-core's public API) and the layer-spec module its quickstart documents.
PUBLIC_MODULES = frozenset({
    "megatron.core", "megatron.core.parallel_state", "megatron.core.tensor_parallel",
    "megatron.core.distributed", "megatron.core.optimizer", "megatron.core.optimizer_param_scheduler",
    "megatron.core.pipeline_parallel", "megatron.core.transformer", "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.dist_checkpointing",
})


@dataclass(frozen=True)
class Pin:
    """One megatron-core name megarl depends on. ``path`` is ``module:qualname``."""

    path: str
    kind: str  # call | attr | self | source
    user: str  # the module that uses it (in megarl/mcore/ unless it names its package)
    why: str
    signature: Optional[str] = None  # kind "call": the recorded call signature
    text: Optional[str] = None  # kind "source": what the source of ``qualname`` must contain

    @property
    def key(self) -> tuple[str, Optional[str]]:
        """What identifies the row (several ``source`` rows may check one object's source)."""
        return (self.path, self.text)

    @property
    def module(self) -> str:
        return self.path.split(":")[0]

    @property
    def qualname(self) -> str:
        return self.path.split(":")[1]


_DOT = "megatron.core.transformer.dot_product_attention"
_OPT = "megatron.core.optimizer.optimizer"
_DISTOPT = "megatron.core.optimizer.distrib_optimizer"
_TORCH_STRAT = "megatron.core.dist_checkpointing.strategies.torch"

CPU_PINS = (
    Pin("megatron.core.tensor_parallel.random:_get_cuda_rng_state", "call", "cpu.py",
        "replaced on CPU by the torch CPU generator (the RNG tracker saves/restores through it)",
        "(device='cuda', clone=False, graph_safe=False)"),
    Pin("megatron.core.tensor_parallel.random:_set_cuda_rng_state", "call", "cpu.py",
        "replaced on CPU by torch.set_rng_state", "(new_state, device=-1, graph_safe=False)"),
    Pin("megatron.core.tensor_parallel.mappings:_AllToAll.backward", "call", "cpu.py",
        "wrapped to run inside the CUDA->CPU mode: autograd runs it outside the process-wide mode",
        "(ctx, *grad_output)"),
    Pin("megatron.core.transformer.moe.moe_utils:maybe_move_tensor_to_cpu", "call", "cpu.py",
        "wrapped so CPU split sizes become numpy (all_to_all_single rejects tensors)",
        "(tensor, as_numpy=False, record_stream=False)"),
    Pin("megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu", "call", "cpu.py",
        "the dispatcher's own binding of the same helper, rebound to the wrapper",
        "(tensor, as_numpy=False, record_stream=False)"),
    Pin("megatron.core.transformer.moe.moe_utils:te_general_gemm", "source", "cpu.py",
        "defined only when TE imports, tested unconditionally by the router: set to None without TE"),
    Pin("megatron.core.jit:enable_jit_fuser", "source", "common/megatron_import.py",
        "binds jit_fuser to torch.compile at import; megatron-core's first import defers that compile "
        "to the fused function's first call", text="jit_fuser = torch.compile"),
    Pin("megatron.core.inference.contexts.dynamic_context:HAVE_WANDB", "attr", "common/megatron_import.py",
        "imports wandb when installed, for hooks megarl does not use: hidden during megatron-core's first import"),
)

ATTENTION_PINS = (
    Pin(f"{_DOT}:DotProductAttention", "call", "sdpa.py",
        "subclassed by SDPAttention (its constructor computes heads, scale and window)",
        "(config, layer_number, attn_mask_type, attention_type, attention_dropout=None, "
        "softmax_scale=None, cp_comm_type=None, pg_collection=None)"),
    Pin(f"{_DOT}:DotProductAttention.forward", "call", "sdpa.py",
        "overridden; the fallback calls it with the same arguments",
        "(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, "
        "packed_seq_params=None)"),
    Pin(f"{_DOT}:DotProductAttention.softmax_scale", "self", "sdpa.py", "the scale passed to torch SDPA"),
    Pin(f"{_DOT}:DotProductAttention.softmax_offset", "self", "sdpa.py", "an offset means: Megatron's path"),
    Pin(f"{_DOT}:DotProductAttention.attention_dropout", "self", "sdpa.py", "dropout while training: Megatron's path"),
    Pin(f"{_DOT}:DotProductAttention.num_query_groups_per_partition", "self", "sdpa.py",
        "GQA when it differs from the query heads"),
    Pin(f"{_DOT}:DotProductAttention.attn_mask_type", "self", "sdpa.py", "the layer's default mask type"),
    Pin(f"{_DOT}:DotProductAttention.layer_number", "self", "sdpa.py", "picks the sliding-window layers"),
    Pin("megatron.core.transformer.enums:AttnMaskType.causal", "attr", "sdpa.py", "causal self-attention"),
    Pin("megatron.core.transformer.enums:AttnMaskType.no_mask", "attr", "sdpa.py", "full attention"),
    Pin("megatron.core.transformer.utils:is_layer_window_attention", "call", "sdpa.py",
        "whether a layer uses the sliding window",
        "(window_size, window_attn_skip_freq, layer_number)"),
    Pin("megatron.core.models.gpt.gpt_layer_specs:get_gpt_layer_local_spec", "attr", "sdpa.py",
        "its spec's submodules.self_attention.submodules.core_attention is replaced by SDPAttention"),
    Pin("megatron.core.packed_seq_params:PackedSeqParams", "call", "packed.py",
        "packed sequences (train.pack_sequences): THD boundaries given to the model and read here",
        "(qkv_format=None, cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None, "
        "cu_seqlens_kv_padded=None, max_seqlen_q=None, max_seqlen_kv=None, local_cp_size=None, cp_group=None)"),
    Pin("megatron.core.transformer.attention:Attention.forward", "source", "sdpa.py",
        "with THD params the core attention gets [T, heads, dim] (the batch dimension squeezed)",
        text="query = query.squeeze(1)"),
    Pin("megatron.core.models.common.embeddings.rope_utils:_apply_rotary_pos_emb_thd", "source", "sdpa.py",
        "RoPE positions restart in every packed sequence (split by cu_seqlens)",
        text="sequence_splits = torch.split(t, seqlens)"),
    Pin("megatron.core.models.common.embeddings.rope_utils:_apply_rotary_pos_emb_thd", "call", "packed.py",
        "replaced by rope_thd (one gather instead of a loop over the sequences), which calls it for CP > 1",
        "(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0, cp_group=None)"),
    Pin("megatron.core.models.common.embeddings.rope_utils:apply_rotary_pos_emb", "source", "packed.py",
        "calls the THD function by its module-global name, so replacing the attribute reroutes it",
        text="return _apply_rotary_pos_emb_thd("),
    Pin("megatron.core.models.common.embeddings.rope_utils:_apply_rotary_pos_emb_bshd", "call", "packed.py",
        "rope_thd applies the gathered table rows with it, as megatron-core's THD path does",
        "(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0)"),
    Pin(f"{_DOT}:DotProductAttention.__init__", "source", "sdpa.py",
        "refuses CP > 1: SDPAttention builds it from a copy of the config at CP=1",
        text="self.config.context_parallel_size == 1"),
    Pin("megatron.core.models.common.embeddings.rope_utils:get_pos_emb_on_this_cp_rank", "source",
        "context_parallel.py", "padded rows under CP: RoPE of chunks r and 2cp-1-r, the layout CPLayout follows",
        text="[cp_rank, (2 * cp_size - cp_rank - 1)]"),
    Pin("megatron.core.models.common.embeddings.rope_utils:_get_thd_freqs_on_this_cp_rank", "source",
        "context_parallel.py", "packed rows under CP: each sequence's two chunks back to back",
        text="freqs[offset + cp_rank * cp_seg : offset + (cp_rank + 1) * cp_seg]"),
)

OPTIMIZER_PINS = (
    Pin(f"{_OPT}:MegatronOptimizer.prepare_grads", "call", "optimizer.py",
        "step part 1: unscale / copy grads to main params; True = loss scaler found inf", "(self)"),
    Pin(f"{_OPT}:MegatronOptimizer.get_grad_norm", "call", "optimizer.py",
        "step part 2: the model-parallel reduced grad norm, checked for NaN before clipping", "(self)"),
    Pin(f"{_OPT}:MegatronOptimizer.step_with_ready_grads", "call", "optimizer.py",
        "step part 4: the update and the main->model param copy", "(self)"),
    Pin(f"{_OPT}:MegatronOptimizer.get_parameters", "call", "optimizer.py", "the params clipped", "(self)"),
    Pin(f"{_OPT}:ChainedOptimizer.prepare_grads", "call", "optimizer.py", "as above, chained", "(self)"),
    Pin(f"{_OPT}:ChainedOptimizer.get_grad_norm", "call", "optimizer.py", "as above, chained", "(self)"),
    Pin(f"{_OPT}:ChainedOptimizer.step_with_ready_grads", "call", "optimizer.py", "as above, chained",
        "(self)"),
    Pin(f"{_OPT}:ChainedOptimizer.chained_optimizers", "self", "optimizer.py, checkpoint.py",
        "the per-group optimizers (clipped one by one; primed and fixed on load)"),
    Pin(f"{_OPT}:MegatronOptimizer.optimizer", "self", "checkpoint.py",
        "the wrapped torch optimizer, whose state is primed and fixed on load"),
    Pin("megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32", "call", "optimizer.py",
        "step part 3: clip by the norm already computed (not recomputed)",
        "(parameters, max_norm, total_norm, use_decoupled_grad=False)"),
    Pin("megatron.core.optimizer.optimizer_config:OptimizerConfig.use_precision_aware_optimizer_no_fp8_or_ds_fp8",
        "self", "optimizer.py", "clip's use_decoupled_grad argument, as Megatron's own step passes it"),
    Pin("megatron.core.optimizer.optimizer_config:OptimizerConfig.use_precision_aware_optimizer", "attr",
        "checkpoint.py", "the load fix applies only without it"),
)

CHECKPOINT_PINS = (
    Pin(f"{_TORCH_STRAT}:MCoreSavePlanner", "call", "checkpoint.py",
        "subclassed so a chunk's data is produced lazily when written",
        "(*args, dedup_replicated_tensors=None, can_run_decentralized_global_plan=True, **kwargs)"),
    Pin(f"{_TORCH_STRAT}:MCoreSavePlanner.resolve_data", "call", "checkpoint.py",
        "overridden: the lazy data hook", "(self, write_item)"),
    Pin(f"{_TORCH_STRAT}:_replace_state_dict_keys_with_sharded_keys", "call", "checkpoint.py",
        "step 1 of torch_dist's save, reused so the files are exactly torch_dist",
        "(sharded_state_dict, keep_only_main_replica=False)"),
    Pin(f"{_TORCH_STRAT}:mcore_to_pyt_state_dict", "call", "checkpoint.py", "step 2 of torch_dist's save",
        "(state_dict, is_loading=False, init_device=device(type='cpu'), "
        "load_legacy_1d_flatten_tensors=False)"),
    Pin("megatron.core.dist_checkpointing.strategies.base:SaveShardedStrategy", "call", "checkpoint.py",
        "base class of the synchronous save strategy", "(backend, version)"),
    Pin("megatron.core.dist_checkpointing.strategies.base:SaveShardedStrategy.can_handle_sharded_objects",
        "attr", "checkpoint.py", "overridden property"),
    Pin(f"{_DISTOPT}:DistributedOptimizer._set_main_param_and_optimizer_states", "call", "checkpoint.py",
        "replaced per instance during a load: 0.16.1 copies 'step', which fully_reshardable keeps per "
        "group", "(self, model_param, tensors)"),
    Pin(f"{_DISTOPT}:DistributedOptimizer.model_param_group_index_map", "self", "checkpoint.py",
        "read by that replacement to find a parameter's main copy"),
    Pin(f"{_DISTOPT}:DistributedOptimizer.checkpoint_fully_reshardable_formats", "attr", "checkpoint.py",
        "must accept 'fully_reshardable', the one distributed-optimizer format that saves and loads here"),
    Pin("megatron.core.dist_checkpointing.mapping:ShardedTensor", "attr", "checkpoint.py",
        "the shape check walks a sharded state dict's tensors (key, global_shape, allow_shape_mismatch)"),
    Pin("megatron.core.dist_checkpointing.mapping:ShardedTensor.from_rank_offsets", "call", "checkpoint.py",
        "mcore->HF conversion asks for one layer (and expert) of a stacked key",
        "(key, data, *rank_offsets, replica_id=0, prepend_axis_num=0, flattened_range=None, **init_kwargs)"),
    Pin("megatron.core.dist_checkpointing.dict_utils:nested_values", "call", "checkpoint.py",
        "iterates a sharded state dict", "(x)"),
    Pin("megatron.core.dist_checkpointing.validation:StrictHandling.RETURN_ALL", "attr", "checkpoint.py",
        "the load returns missing keys so they are named in one line"),
)

_ROUTER = "megatron.core.transformer.moe.router"
_GPT = "megatron.core.models.gpt.gpt_model"
_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
_TCONF = "megatron.core.transformer.transformer_config"

ROUTING_REPLAY_PINS = (
    Pin(f"{_ROUTER}:TopKRouter.routing", "call", "routing_replay.py",
        "wrapped per router instance: the replayed ids and weights replace its top-k",
        "(self, logits, padding_mask=None)"),
    Pin(f"{_ROUTER}:TopKRouter.forward", "source", "routing_replay.py",
        "the forward goes through the instance's routing, so the per-instance wrapper is what runs",
        text="self.routing(logits, padding_mask=padding_mask)"),
    Pin(f"{_ROUTER}:TopKRouter.set_layer_number", "call", "routing_replay.py",
        "sets the global (stage-offset) layer number that indexes a route's layer axis",
        "(self, layer_number)"),
    Pin(f"{_ROUTER}:Router.set_layer_number", "source", "routing_replay.py",
        "the router keeps that number as given (1-based, global): route layer = layer_number - 1",
        text="self.layer_number = layer_number"),
    Pin(f"{_ROUTER}:TopKRouter.topk", "self", "routing_replay.py", "k of the replayed ids"),
    Pin(f"{_ROUTER}:TopKRouter.score_function", "self", "routing_replay.py",
        "softmax or sigmoid: the trainer's probabilities at the replayed ids"),
    Pin(f"{_ROUTER}:TopKRouter.expert_bias", "self", "routing_replay.py", "passed through to the score math"),
    Pin(f"{_MOE_UTILS}:topk_routing_with_score_function", "call", "routing_replay.py",
        "megatron-core's score math, called with a router_replay hook that returns the rollout's ids",
        "(logits, topk, use_pre_softmax=False, num_groups=None, group_topk=None, scaling_factor=None, "
        "score_function='softmax', expert_bias=None, fused=False, router_replay=None)"),
    Pin(f"{_MOE_UTILS}:topk_routing_with_score_function", "source", "routing_replay.py",
        "the hook is asked for the top-k: get_replay_topk(scores, topk, num_groups, group_topk, "
        "default_compute_topk) returns (scores at the ids, ids)", text="router_replay.get_replay_topk("),
    Pin(f"{_TCONF}:TransformerConfig.moe_router_pre_softmax", "attr", "routing_replay.py",
        "softmax before or after the top-k"),
    Pin(f"{_TCONF}:TransformerConfig.moe_router_num_groups", "attr", "routing_replay.py", "group-limited routing"),
    Pin(f"{_TCONF}:TransformerConfig.moe_router_group_topk", "attr", "routing_replay.py", "group-limited routing"),
    Pin(f"{_TCONF}:TransformerConfig.moe_router_topk_scaling_factor", "attr", "routing_replay.py",
        "scales the replayed probabilities like the router's own"),
)

MOE_LOSS_PINS = (
    Pin(f"{_MOE_UTILS}:clear_aux_losses_tracker", "call", "moe.py",
        "zeroes the per-layer router-loss values before a step", "()"),
    Pin(f"{_MOE_UTILS}:get_moe_layer_wise_logging_tracker", "call", "moe.py",
        "the per-layer load-balancing / z-loss values the routers saved in the step's forwards", "()"),
    Pin(f"{_MOE_UTILS}:save_to_aux_losses_tracker", "source", "moe.py",
        "a tracker entry's per-layer values are under 'values'", text='tracker[name]["values"]'),
    Pin(f"{_MOE_UTILS}:save_to_aux_losses_tracker", "source", "moe.py",
        "and the group the router split the loss over (TP x CP) under 'reduce_group'",
        text='tracker[name]["reduce_group"] = reduce_group'),
    Pin(f"{_TCONF}:TransformerConfig.moe_aux_loss_coeff", "attr", "moe.py",
        "set on the model's config before each step (the step's token-weighted coefficient)"),
    Pin(f"{_TCONF}:TransformerConfig.moe_z_loss_coeff", "attr", "moe.py",
        "set likewise; None switches the z-loss off"),
    Pin(f"{_ROUTER}:TopKRouter._apply_aux_loss", "source", "moe.py",
        "the load-balancing coefficient is looked up at each forward, so a per-step value applies",
        text='self.get_aux_loss_coeff("aux_loss")'),
    Pin(f"{_ROUTER}:TopKRouter.get_aux_loss_coeff", "source", "moe.py",
        "and read from the config (not copied at construction)", text="return self.config.moe_aux_loss_coeff"),
    Pin(f"{_ROUTER}:TopKRouter.apply_z_loss", "source", "moe.py",
        "the z-loss reads the config at each forward and is skipped when its coefficient is None",
        text="if self.config.moe_z_loss_coeff is not None"),
)

_TLAYER = "megatron.core.transformer.transformer_layer"

MODEL_PINS = (
    Pin(f"{_GPT}:GPTModel.decoder", "self", "model.py", "the TransformerBlock holding this stage's layers"),
    Pin("megatron.core.transformer.transformer_block:TransformerBlock.layers", "self", "model.py",
        "this stage's layers, in the order their parameters are named (decoder.layers.<local i>)"),
    Pin(f"{_TLAYER}:TransformerLayer.layer_number", "self", "model.py",
        "1-based global layer number (with the pipeline stage's offset): names a parameter's layer in "
        "the HF table"),
    Pin(f"{_TLAYER}:TransformerLayer.mlp", "self", "model.py", "the layer's MLP or MoE layer"),
    Pin("megatron.core.transformer.moe.moe_layer:BaseMoELayer.local_expert_indices", "self", "model.py",
        "global indices of this EP rank's experts: names an expert's parameters in the HF table"),
)

HEAD_PINS = (
    Pin(f"{_GPT}:GPTModel.output_layer", "self", "heads.py", "replaced by the critic's value head"),
    Pin(f"{_GPT}:GPTModel.post_process", "self", "heads.py", "only the last stage's chunk holds the head"),
    Pin(f"{_GPT}:GPTModel.share_embeddings_and_output_weights", "self", "heads.py",
        "set False: the replaced head is not tied to the input embedding"),
    Pin(f"{_GPT}:GPTModel._postprocess", "call", "heads.py",
        "calls output_layer(hidden, weight=, runtime_gather_output=) and reads its sequence_parallel",
        "(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos, "
        "rotary_pos_sin, mtp_in_postprocess=None, loss_mask=None, decoder_input=None, attention_mask=None, "
        "inference_params=None, packed_seq_params=None, sequence_len_offset=None, runtime_gather_output=None, "
        "extra_block_kwargs=None, inference_context=None)"),
    Pin("megatron.core.tensor_parallel.layers:ColumnParallelLinear.forward", "call", "heads.py",
        "the call signature a replacement head takes", "(self, input_, weight=None, runtime_gather_output=None)"),
    Pin("megatron.core.tensor_parallel.layers:ColumnParallelLinear.sequence_parallel", "self", "heads.py",
        "the head attribute _postprocess reads; a replacement sets it False"),
)

_TPL = "megatron.core.tensor_parallel.layers"
_MAP = "megatron.core.tensor_parallel.mappings"

LORA_PINS = (
    Pin(f"{_MAP}:copy_to_tensor_model_parallel_region", "call", "lora.py",
        "a column layer's adapter: identity forward, TP all-reduce of the gradient of A x",
        "(input_, group=None)"),
    Pin(f"{_MAP}:reduce_from_tensor_model_parallel_region", "call", "lora.py",
        "a row layer's adapter: the partial products A_r x_r summed over TP before B",
        "(input_, group=None)"),
    Pin("megatron.core.transformer.utils:make_sharded_tensors_for_checkpoint", "call", "lora.py",
        "A or B sharded along its own TP dimension in distributed checkpoints",
        "(state_dict, prefix, tensor_parallel_layers_axis_map=None, sharded_offsets=(), "
        "extra_state_suffix='_extra_state', tp_group=None, dp_cp_group=None)"),
    Pin("megatron.core.transformer.mlp:apply_swiglu_sharded_factory", "call", "lora.py",
        "linear_fc1's B in Megatron's [gate_r; up_r] split, like the base weight",
        "(original_sh_ten, sharded_offsets, singleton_local_shards=False)"),
    Pin(f"{_TPL}:set_tensor_model_parallel_attributes", "call", "lora.py",
        "marks the split adapter (B of a column layer, A of a row layer) as TP-parallel for grad "
        "norms and checkpoints", "(tensor, is_parallel, dim, stride)"),
    Pin(f"{_TPL}:ColumnParallelLinear.tp_group", "self", "lora.py", "the TP group an adapter reduces over"),
    Pin(f"{_TPL}:RowParallelLinear.tp_group", "self", "lora.py", "the TP group an adapter reduces over"),
)

PINS = (CPU_PINS + ATTENTION_PINS + OPTIMIZER_PINS + CHECKPOINT_PINS + ROUTING_REPLAY_PINS + MOE_LOSS_PINS
        + MODEL_PINS + HEAD_PINS + LORA_PINS)


def call_signature(obj) -> str:
    """``(a, b=1, *args, c=None, **kw)``: names, kinds and defaults, without annotations."""
    parts, star = [], False
    for p in inspect.signature(obj).parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        else:
            if p.kind is p.KEYWORD_ONLY and not star:
                parts.append("*")
                star = True
            parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return f"({', '.join(parts)})"


def _resolve(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)  # on a class: methods keep self, classmethods come bound
    return obj


def pin_problem(pin: Pin) -> Optional[str]:
    """What no longer holds for ``pin`` in the installed megatron-core, or None."""
    try:
        if pin.kind == "self":
            cls, attr = pin.qualname.rsplit(".", 1)
            source = inspect.getsource(_resolve(pin.module, cls))
            return None if f"self.{attr}" in source else f"{pin.path}: gone (no longer sets self.{attr})"
        if pin.kind == "source" and pin.text is not None:
            source = inspect.getsource(_resolve(pin.module, pin.qualname))
            return None if pin.text in source else f"{pin.path}: no longer contains {pin.text!r}"
        if pin.kind == "source":
            source = inspect.getsource(importlib.import_module(pin.module))
            return None if pin.qualname in source else f"{pin.path}: gone (no longer mentioned)"
        obj = _resolve(pin.module, pin.qualname)
    except (ImportError, AttributeError, OSError, TypeError) as e:
        return f"{pin.path}: gone ({type(e).__name__}: {e})"
    if pin.kind == "call":
        have = call_signature(obj)
        if have != pin.signature:
            return f"{pin.path}: signature changed: recorded {pin.signature}, installed {have}"
    return None


def pin_problems(pins=None) -> list[str]:
    """Every entry of ``pins`` (default: the whole table) that no longer matches, plus the behaviour
    checks a name alone cannot show. Empty when all is well; never called at run time."""
    pins = PINS if pins is None else pins
    problems = [p for p in (pin_problem(pin) for pin in pins) if p]
    if not problems and pins is PINS:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        if "fully_reshardable" not in DistributedOptimizer.checkpoint_fully_reshardable_formats:
            problems.append(f"{_DISTOPT}:DistributedOptimizer.checkpoint_fully_reshardable_formats: "
                            "no longer accepts 'fully_reshardable'")
    return problems


def markdown_table() -> str:
    """The table as docs/architecture.md shows it (tests/unit/test_mcore_guard.py keeps the two equal)."""
    rows = ["| megatron-core name | kind | used in megarl/mcore/ | why |", "|---|---|---|---|"]
    for pin in PINS:
        name = f"`{pin.path}`" + (f" contains `{pin.text}`" if pin.text is not None else "")
        rows.append(f"| {name} | {pin.kind} | {pin.user} | {pin.why} |")
    return "\n".join(rows)
