"""Per-architecture weight tables, keyed on HF ``config.json`` ``architectures[0]``.

A table lists, for every Megatron parameter (local layer spec names, ``{L}`` = global layer
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
from dataclasses import dataclass
from typing import Optional

PLAIN, QKV, GATE_UP, VOCAB = "plain", "qkv", "gate_up", "vocab"


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
class ModelArgs:
    """The HF config fields megarl uses, read once from config.json, plus the Megatron-side
    vocabulary padding (set by :func:`megarl.models.layouts.pad_vocab`, never read from HF)."""

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
    rope_scaling_factor: Optional[float] = None
    initializer_range: float = 0.02
    sliding_window: Optional[int] = None  # attention window W (a token sees itself + W-1 back)
    window_layers: Optional[tuple[bool, ...]] = None  # per layer: windowed? (None: all layers)
    padded_vocab_size: Optional[int] = None  # Megatron rows of embedding/output (None: vocab_size)
    num_experts: int = 0  # MoE: routed experts per layer (0: dense MLP)
    moe_topk: int = 0  # MoE: experts per token
    moe_ffn_hidden_size: int = 0  # MoE: intermediate size of one expert
    moe_norm_topk: bool = True  # MoE: renormalise the top-k routing probabilities

    @property
    def mcore_vocab_size(self) -> int:
        return self.padded_vocab_size or self.vocab_size


@dataclass(frozen=True)
class Architecture:
    name: str
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


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("LlamaForCausalLM", qkv_bias=False, qk_norm=False),
    "MistralForCausalLM": Architecture("MistralForCausalLM", qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": Architecture("Qwen2ForCausalLM", qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": Architecture("Qwen3ForCausalLM", qkv_bias=False, qk_norm=True),
    "Qwen3MoeForCausalLM": Architecture("Qwen3MoeForCausalLM", qkv_bias=False, qk_norm=True),
}


def get_architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ValueError(f"architectures[0]={name!r} is not supported; supported: "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[name]


def te_name(mcore_name: str, moe: bool = False) -> str:
    """Local-spec name -> TE-spec name (norms fused into the next linear layer; an MoE layer's
    pre-MLP norm stays a separate module under TE, so only the attention norm moves)."""
    name = mcore_name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
    return name if moe else name.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")


def read_model_args(hf_dir: str) -> ModelArgs:
    """Parses ``<hf_dir>/config.json``; errors name the file and the field."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: not found (an HF model directory needs config.json)")
    try:
        with open(path) as f:
            hf = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    archs = hf.get("architectures") or []
    if not archs:
        raise ValueError(f"{path}: 'architectures' is missing")
    arch = get_architecture(archs[0])

    def need(key):
        if key not in hf:
            raise ValueError(f"{path}: '{key}' is missing")
        return hf[key]

    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    # transformers >= 5 writes RoPE settings into "rope_parameters"; older configs use top-level
    # rope_theta / rope_scaling. A default-type rope_parameters carries only the theta.
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    factor = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise ValueError(f"{path}: rope_scaling type {kind!r} is not supported (only llama3)")
        factor = float(scaling["factor"])
    return ModelArgs(
        architecture=arch.name,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        ffn_hidden_size=need("intermediate_size"),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch.qkv_bias or bool(hf.get("attention_bias", False)),
        qk_norm=arch.qk_norm,
        rope_scaling_factor=factor,
        initializer_range=float(hf.get("initializer_range", 0.02)),
        **_sliding_window(arch.name, hf, need("num_hidden_layers"), path),
        **(_moe(hf, path) if arch.name == "Qwen3MoeForCausalLM" else {}),
    )


def _moe(hf: dict, path: str) -> dict:
    """ModelArgs MoE fields of a Qwen3-MoE config. Only the all-MoE layout of the released models
    is supported: a dense layer (``mlp_only_layers``, ``decoder_sparse_step`` > 1) is refused."""
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    for key, value in (("num_experts", experts), ("num_experts_per_tok", hf.get("num_experts_per_tok")),
                       ("moe_intermediate_size", hf.get("moe_intermediate_size"))):
        if not value:
            raise ValueError(f"{path}: '{key}' is missing")
    if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1:
        raise ValueError(f"{path}: mlp_only_layers / decoder_sparse_step > 1 (dense layers in an MoE "
                         "model) are not supported")
    return {"num_experts": int(experts), "moe_topk": int(hf["num_experts_per_tok"]),
            "moe_ffn_hidden_size": int(hf["moe_intermediate_size"]),
            # absent: False, transformers' Qwen3MoeConfig default (the released configs say true)
            "moe_norm_topk": bool(hf.get("norm_topk_prob", False))}


def _sliding_window(arch: str, hf: dict, num_layers: int, path: str) -> dict:
    """ModelArgs.sliding_window / window_layers the way transformers reads them: Mistral windows
    every layer; otherwise an explicit ``layer_types`` list decides; Qwen2/3 with ``use_sliding_window``
    window the layers from ``max_window_layers`` on (transformers' default 28 when absent);
    Qwen3-MoE windows every layer exactly when ``use_sliding_window`` (it reads neither
    ``layer_types`` nor ``max_window_layers``)."""
    window = hf.get("sliding_window")
    if arch == "MistralForCausalLM":  # transformers' Mistral ignores layer_types
        layers = (True,) * num_layers
    elif arch == "Qwen3MoeForCausalLM":
        layers = (bool(hf.get("use_sliding_window")),) * num_layers
    elif isinstance(hf.get("layer_types"), list):
        layers = tuple(t == "sliding_attention" for t in hf["layer_types"])
        if len(layers) != num_layers:
            raise ValueError(f"{path}: layer_types has {len(layers)} entries for {num_layers} layers")
    elif hf.get("use_sliding_window"):
        start = int(hf.get("max_window_layers", 28))
        layers = tuple(i >= start for i in range(num_layers))
    else:
        layers = (False,) * num_layers
    if not window or not any(layers):
        return {}
    if int(window) < 1:
        raise ValueError(f"{path}: sliding_window must be >= 1, got {window}")
    return {"sliding_window": int(window), "window_layers": None if all(layers) else layers}


def param_table(args: ModelArgs) -> list[tuple[Optional[int], ParamMap]]:
    """Every (layer or None, ParamMap) of the model, in HF order: embedding, layers, norm, head."""
    arch = Architecture(args.architecture, args.qkv_bias, args.qk_norm, args.num_experts)
    rows: list[tuple[Optional[int], ParamMap]] = [(None, arch.embedding())]
    for layer in range(args.num_layers):
        rows += [(layer, m) for m in arch.layer_table()]
    rows.append((None, arch.final_norm()))
    if not args.tie_word_embeddings:
        rows.append((None, arch.output_layer()))
    return rows
