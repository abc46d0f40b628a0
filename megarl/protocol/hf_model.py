"""The HF model description (read once from ``config.json``) and the per-architecture weight tables.

:func:`read_model_args` is the one reader of an HF ``config.json``: it looks the architecture up
in the one table (:mod:`megarl.protocol.architectures`), reads every field megarl's programs use
into one :class:`ModelArgs` (sizes, heads, RoPE, sliding windows per layer, MoE shape, tying,
biases, q/k norm, a classifier's score head, special token ids) and refuses, naming the file,
the field and the program, what the program that asked (``program``) cannot run. The trainer's
model builder and converters, preflight and megarl-server all build from it.

A weight table lists, for every Megatron parameter (local layer spec names, ``{L}`` = global layer
index), the HF tensors it is made of, how they combine (plain copy, fused QKV, fused gate/up) and
the tensor-parallel dimension. Embedding and output-layer rows are ``vocab`` rows: Megatron holds
them padded to ``ModelArgs.padded_vocab_size`` (:func:`megarl.models.layouts.pad_vocab`), HF
holds the original vocabulary. The TE spec fuses the pre-attention/pre-MLP norms into the
following linear layer; :func:`te_name` maps those two names.

Mixture-of-experts architectures (Qwen3-MoE) replace the MLP rows of every layer by a router row
and one fc1 (gate/up) + fc2 row per expert, each row naming its *global* expert index (Megatron's
``local_experts.{e}`` of expert-parallel rank r is global expert ``r * E/EP + e``; ``hf_io``
translates). Experts are not split over TP (``expert_tensor_parallel_size=1``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

from megarl.protocol.architectures import (  # noqa: F401 - ARCHITECTURES, get_architecture: re-exported
    ARCHITECTURES, MEGATRON_LLAMA3, MOE_SHARED, ROPE_TYPES, SERVER, TRAINER, WINDOW_ALL, WINDOW_ALL_IF_USED,
    WINDOW_FROM_MAX, WINDOW_NONE, Architecture, get_architecture)

PLAIN, QKV, GATE_UP, VOCAB = "plain", "qkv", "gate_up", "vocab"


@dataclass(frozen=True)
class ModelArgs:
    """The HF config fields megarl uses, read once from config.json (:func:`read_model_args`), plus
    the Megatron-side vocabulary padding (set by :func:`megarl.models.layouts.pad_vocab`, never
    read from HF)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_scaling_factor: Optional[float] = None  # llama3 scaling's factor (None: no llama3 scaling)
    initializer_range: float = 0.02
    sliding_window: Optional[int] = None  # attention window W (a token sees itself + W-1 back)
    window_layers: Optional[tuple[bool, ...]] = None  # per layer: windowed? (None: all layers)
    padded_vocab_size: Optional[int] = None  # Megatron rows of embedding/output (None: vocab_size)
    num_experts: int = 0  # MoE: routed experts per layer (0: dense MLP)
    moe_topk: int = 0  # MoE: experts per token
    moe_ffn_hidden_size: int = 0  # MoE: intermediate size of one expert
    moe_norm_topk: bool = True  # MoE: renormalise the top-k routing probabilities
    moe_shared_ffn_hidden_size: int = 0  # MoE: a gated shared expert's intermediate size (0: none)
    moe_layers: Optional[tuple[bool, ...]] = None  # MoE: per layer, experts? (None: every layer)
    rope_scaling: Optional[dict] = field(default=None, hash=False)  # HF rope_scaling (None: default RoPE)
    o_bias: bool = False  # o_proj has a bias (attention_bias of Llama / Qwen3 / Qwen3-MoE)
    mlp_bias: bool = False  # gate/up/down projections have biases (Llama's mlp_bias)
    num_labels: int = 0  # a sequence classifier's score rows (0: a causal LM with lm_head)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None

    @property
    def mcore_vocab_size(self) -> int:
        return self.padded_vocab_size or self.vocab_size

    @property
    def layer_windows(self) -> tuple[Optional[int], ...]:
        """Per layer: its sliding window W, or None (full attention)."""
        on = self.window_layers or (True,) * self.num_layers
        return tuple(self.sliding_window if self.sliding_window and w else None for w in on)


# ----------------------------------------------------------------------------- the reader

def read_model_args(hf_dir: str, program: str = TRAINER) -> ModelArgs:
    """Parses ``<hf_dir>/config.json`` for ``program`` (:data:`TRAINER` or :data:`SERVER`); errors
    are one line naming the file and the field (and the program, for what it cannot run)."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: not found (an HF model directory needs config.json)")
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    return model_args_from_config(hf, path, program)


def model_args_from_config(hf: dict, path: str = "config.json", program: str = TRAINER) -> ModelArgs:
    """The description of a parsed config.json (``path`` names it in errors); see `read_model_args`."""
    try:
        return _describe(hf, path, program)
    except (TypeError, AttributeError, ValueError) as e:  # a wrongly typed field: float("x"), {}.get on a list
        if str(e).startswith(f"{path}: "):
            raise
        raise ValueError(f"{path}: {e}") from None


def _describe(hf: dict, path: str, program: str) -> ModelArgs:
    if not isinstance(hf, dict):
        raise ValueError(f"{path}: must hold a JSON object, not {type(hf).__name__}")
    archs = hf.get("architectures")
    if archs is not None and not isinstance(archs, list):
        raise ValueError(f"{path}: 'architectures' must be a list of class names, e.g. [{json.dumps(str(archs))}]; "
                         f"got {type(archs).__name__} {archs!r}")
    if not archs or not isinstance(archs[0], str):
        raise ValueError(f"{path}: 'architectures' is missing")
    arch = get_architecture(archs[0], program, path)
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{path}: hidden_act {act!r} is not supported (only 'silu')")

    def need(key):
        if hf.get(key) is None:
            raise ValueError(f"{path}: '{key}' is missing")
        return _count(hf, key, path)

    heads, hidden, layers = need("num_attention_heads"), need("hidden_size"), need("num_hidden_layers")
    attention_bias = bool(hf.get("attention_bias", False))
    if arch.qkv_bias is None:  # attention_bias biases q, k, v and o
        qkv_bias, o_bias = attention_bias, attention_bias
    else:
        qkv_bias, o_bias = arch.qkv_bias and bool(hf.get(arch.qkv_bias_key, True)), False
    classifier = arch.classifier
    windows = _layer_windows(arch.window, hf, layers, path)
    eos = hf.get("eos_token_id")
    args = ModelArgs(
        architecture=arch.name,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_count(hf, "num_key_value_heads", path) if hf.get("num_key_value_heads") is not None else heads,
        head_dim=_count(hf, "head_dim", path) if hf.get("head_dim") is not None else hidden // heads,
        ffn_hidden_size=need("intermediate_size"),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)) and not classifier,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=arch.qk_norm,
        initializer_range=float(hf.get("initializer_range", 0.02)),
        sliding_window=next((w for w in windows if w), None),
        window_layers=None if all(windows) or not any(windows) else tuple(w is not None for w in windows),
        num_labels=(len(hf.get("id2label") or {}) or int(hf.get("num_labels", 2))) if classifier else 0,
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        bos_token_id=hf.get("bos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
        **_rope(hf, path),
        **(_moe(arch, hf, layers, path) if arch.moe else {}),
    )
    require(args, program, path)
    return args


def require(args: ModelArgs, program: str, path: str = "config.json") -> None:
    """Refuses what ``program`` cannot compute within a supported architecture (one line naming
    the file, the field and the program): RoPE scalings other than :data:`ROPE_TYPES`; for the
    trainer also Megatron's fixed llama3 constants, o_proj / MLP biases (its layers have none)
    and dense layers in an MoE model (its tables put experts in every layer)."""
    kind = (args.rope_scaling or {}).get("rope_type", (args.rope_scaling or {}).get("type", "default"))
    if kind not in ROPE_TYPES[program]:
        only = ", ".join(t for t in ROPE_TYPES[program] if t != "default")
        raise ValueError(f"{path}: rope_scaling type {kind!r} is not supported by {program} (only {only})")
    if program != TRAINER:
        return
    if kind == "llama3":
        for key, fixed in MEGATRON_LLAMA3.items():
            if float(args.rope_scaling.get(key, fixed)) != fixed:
                raise ValueError(f"{path}: rope_scaling.{key}={args.rope_scaling[key]} is not supported by "
                                 f"{program} (Megatron's llama3 RoPE fixes it to {fixed:g})")
    if args.o_bias:
        raise ValueError(f"{path}: attention_bias=true (an o_proj bias) is not supported by {program}")
    if args.mlp_bias:
        raise ValueError(f"{path}: mlp_bias=true is not supported by {program}")
    if args.moe_layers is not None:
        raise ValueError(f"{path}: mlp_only_layers / decoder_sparse_step > 1 (dense layers in an MoE model) "
                         f"are not supported by {program}")


def _count(hf: dict, key: str, path: str) -> int:
    v = hf[key]
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{path}: {key} must be a positive integer, got {v!r}")
    return v


def _rope(hf: dict, path: str) -> dict:
    """rope_theta / rope_scaling / rope_scaling_factor. transformers >= 5 writes RoPE settings into
    ``rope_parameters``; older configs use top-level rope_theta / rope_scaling. A default-type
    rope_parameters carries only the theta."""
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"{path}: rope_scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        scaling = None
    elif kind in ("linear", "llama3") and "factor" not in scaling:
        raise ValueError(f"{path}: rope_scaling.factor is missing")
    return {"rope_theta": theta, "rope_scaling": scaling,
            "rope_scaling_factor": float(scaling["factor"]) if kind == "llama3" else None}


def _moe(arch: Architecture, hf: dict, num_layers: int, path: str) -> dict:
    """The MoE fields: experts, top-k, expert (and shared expert) width, which layers have experts
    (``mlp_only_layers``, ``decoder_sparse_step``)."""
    experts = hf.get("num_experts", hf.get("num_local_experts"))  # transformers 5 writes the latter
    for key, value in (("num_experts", experts), ("num_experts_per_tok", hf.get("num_experts_per_tok")),
                       ("moe_intermediate_size", hf.get("moe_intermediate_size"))):
        if not value:
            raise ValueError(f"{path}: '{key}' is missing")
    experts, top_k = int(experts), int(hf["num_experts_per_tok"])
    if not 1 <= top_k <= experts:
        raise ValueError(f"{path}: num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
    dense_only = set(hf.get("mlp_only_layers") or ())
    step = int(hf.get("decoder_sparse_step") or 1)
    layers = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(num_layers))
    return {"num_experts": experts, "moe_topk": top_k, "moe_ffn_hidden_size": int(hf["moe_intermediate_size"]),
            # absent: False, transformers' default (the released Qwen3-MoE configs say true)
            "moe_norm_topk": bool(hf.get("norm_topk_prob", False)),
            "moe_shared_ffn_hidden_size": int(hf.get("shared_expert_intermediate_size", 5632))
            if arch.moe == MOE_SHARED else 0,
            "moe_layers": None if all(layers) else layers}


def _layer_windows(rule: str, hf: dict, num_layers: int, path: str) -> tuple[Optional[int], ...]:
    """Each layer's sliding window as transformers 5 builds the model from this config.json:
    Mistral windows every layer (its ``layer_types`` are ignored); the Qwen models window nothing
    without ``use_sliding_window``; with it, Qwen3-MoE windows every layer and Qwen2/Qwen3/Qwen2-MoE
    follow ``layer_types`` when the config lists them, else their ``max_window_layers`` default
    (Qwen2/3: layers >= it; Qwen2-MoE: even-indexed layers below it)."""
    window = hf.get("sliding_window")
    if rule == WINDOW_NONE or not window or (rule != WINDOW_ALL and not hf.get("use_sliding_window")):
        return (None,) * num_layers
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"{path}: sliding_window must be an integer >= 1, got {window!r}")
    types = hf.get("layer_types")
    if rule in (WINDOW_ALL, WINDOW_ALL_IF_USED):
        on = [True] * num_layers
    elif isinstance(types, list):
        if len(types) != num_layers:
            raise ValueError(f"{path}: layer_types has {len(types)} entries for {num_layers} layers")
        on = [t == "sliding_attention" for t in types]
    elif rule == WINDOW_FROM_MAX:
        on = [i >= int(hf.get("max_window_layers", 28)) for i in range(num_layers)]
    else:  # WINDOW_EVEN_BELOW_MAX (transformers' Qwen2-MoE default)
        on = [(i + 1) % 2 == 1 and i < int(hf.get("max_window_layers", 28)) for i in range(num_layers)]
    return tuple(window if o else None for o in on)


# ----------------------------------------------------------------------------- weight tables

@dataclass(frozen=True)
class ParamMap:
    mcore: str  # Megatron name; {L} is the global layer index
    hf: tuple[str, ...]  # HF names; {L} likewise
    kind: str = PLAIN  # plain | qkv | gate_up | vocab (rows padded on the Megatron side)
    tp_dim: Optional[int] = None  # None: replicated across TP
    expert: Optional[int] = None  # global expert index of an MoE expert row

    def names(self, layer: Optional[int] = None) -> tuple[str, tuple[str, ...]]:
        if layer is None:
            return self.mcore, self.hf
        return self.mcore.format(L=layer), tuple(h.format(L=layer) for h in self.hf)


@dataclass(frozen=True)
class WeightTable:
    """The rows of one model's layers, from its description (`param_table`)."""

    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0  # > 0: MoE MLP (Qwen3-MoE names) in every layer

    def layer_table(self) -> list[ParamMap]:
        p, a = "model.layers.{L}.", "decoder.layers.{L}."
        table = [
            ParamMap(a + "input_layernorm.weight", (p + "input_layernorm.weight",)),
            ParamMap(a + "self_attention.linear_qkv.weight",
                     tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv"), QKV, 0),
        ]
        if self.qkv_bias:
            table.append(ParamMap(a + "self_attention.linear_qkv.bias",
                                  tuple(p + f"self_attn.{x}_proj.bias" for x in "qkv"), QKV, 0))
        if self.qk_norm:
            table += [ParamMap(a + "self_attention.q_layernorm.weight", (p + "self_attn.q_norm.weight",)),
                      ParamMap(a + "self_attention.k_layernorm.weight", (p + "self_attn.k_norm.weight",))]
        table += [
            ParamMap(a + "self_attention.linear_proj.weight", (p + "self_attn.o_proj.weight",), PLAIN, 1),
            ParamMap(a + "pre_mlp_layernorm.weight", (p + "post_attention_layernorm.weight",)),
        ]
        if self.num_experts:
            return table + self.moe_table()
        return table + [
            ParamMap(a + "mlp.linear_fc1.weight", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                     GATE_UP, 0),
            ParamMap(a + "mlp.linear_fc2.weight", (p + "mlp.down_proj.weight",), PLAIN, 1),
        ]

    def moe_table(self) -> list[ParamMap]:
        """Router + per-expert rows (Qwen3-MoE names; fc1 = [gate; up] like the dense MLP)."""
        p, a = "model.layers.{L}.mlp.", "decoder.layers.{L}.mlp."
        table = [ParamMap(a + "router.weight", (p + "gate.weight",))]
        for e in range(self.num_experts):
            mine, theirs = f"{a}experts.local_experts.{e}.", f"{p}experts.{e}."
            table += [
                ParamMap(mine + "linear_fc1.weight", (theirs + "gate_proj.weight", theirs + "up_proj.weight"),
                         GATE_UP, None, e),
                ParamMap(mine + "linear_fc2.weight", (theirs + "down_proj.weight",), PLAIN, None, e),
            ]
        return table

    def embedding(self) -> ParamMap:
        return ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB, 0)

    def final_norm(self) -> ParamMap:
        return ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",))

    def output_layer(self) -> ParamMap:
        return ParamMap("output_layer.weight", ("lm_head.weight",), VOCAB, 0)


def te_name(mcore_name: str, moe: bool = False) -> str:
    """Local-spec name -> TE-spec name (norms fused into the next linear layer; an MoE layer's
    pre-MLP norm stays a separate module under TE, so only the attention norm moves)."""
    name = mcore_name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
    return name if moe else name.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")


def param_table(args: ModelArgs) -> list[tuple[Optional[int], ParamMap]]:
    """Every (layer or None, ParamMap) of the model, in HF order: embedding, layers, norm, head."""
    arch = WeightTable(args.qkv_bias, args.qk_norm, args.num_experts)
    rows: list[tuple[Optional[int], ParamMap]] = [(None, arch.embedding())]
    for layer in range(args.num_layers):
        rows += [(layer, m) for m in arch.layer_table()]
    rows.append((None, arch.final_norm()))
    if not args.tie_word_embeddings:
        rows.append((None, arch.output_layer()))
    return rows
