"""The one table of HF architectures megarl knows, keyed on ``config.json`` ``architectures[0]``.

Every program that reads an HF model (the trainer's model builder and converters, preflight,
megarl-server, the SGLang launcher) looks its architecture up here, through the one reader
:func:`megarl.protocol.hf_model.read_model_args`. A row says what differs between architectures
(biases, q/k norms, how transformers picks the windowed layers, the MoE kind, a classifier's
base) and which programs can run it (``programs``): an architecture one program serves and
another cannot build is one row with one capability set, never two lists. What a program cannot
do *within* an architecture (a RoPE scaling type, dense layers in an MoE model) is
:data:`ROPE_TYPES` and the checks of :func:`megarl.protocol.hf_model.require`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

TRAINER = "the trainer"  # Megatron model builder: megarl-train, megarl-eval, megarl-convert, megarl-logprobs
SERVER = "megarl-server"  # the CPU inference server (megarl/server)
PROGRAMS = (TRAINER, SERVER)

# RoPE scaling types each program computes ("default" = none). The trainer's Megatron rotary
# embedding has llama3 only, with its low/high frequency factors and original context fixed.
ROPE_TYPES = {TRAINER: ("default", "llama3"), SERVER: ("default", "linear", "llama3")}
MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# How transformers picks the windowed layers (`megarl.protocol.hf_model._layer_windows`)
WINDOW_NONE = "none"  # no sliding window
WINDOW_ALL = "all"  # every layer whenever sliding_window is set (Mistral ignores use_sliding_window)
WINDOW_ALL_IF_USED = "all_if_used"  # every layer when use_sliding_window (Qwen3-MoE)
WINDOW_FROM_MAX = "from_max_window_layers"  # layer_types, else layers >= max_window_layers (Qwen2/3)
WINDOW_EVEN_BELOW_MAX = "even_below_max_window_layers"  # layer_types, else even layers < it (Qwen2-MoE)

MOE_EXPERTS = "experts"  # routed experts in every MoE layer (Qwen3-MoE)
MOE_SHARED = "experts+shared"  # routed experts plus a gated shared expert (Qwen2-MoE)


@dataclass(frozen=True)
class Architecture:
    """One row of the table: what differs between the supported HF architectures."""

    name: str  # HF architectures[0]
    model_type: str  # HF model_type (also the name of SGLang's model module)
    qkv_bias: Optional[bool]  # None: follows config attention_bias (which then biases o_proj too)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    window: str = WINDOW_NONE
    moe: str = ""  # "": dense MLP; MOE_EXPERTS or MOE_SHARED
    qkv_bias_key: str = ""  # config key that switches the q/k/v bias off (Qwen2-MoE: qkv_bias)
    base: str = ""  # a sequence classifier: the causal LM whose decoder it has, score head for lm_head
    programs: frozenset[str] = frozenset(PROGRAMS)  # the programs that can run it

    @property
    def classifier(self) -> bool:
        return bool(self.base)


def _classifier(base: Architecture, name: str, programs=frozenset({SERVER})) -> Architecture:
    """A ``*ForSequenceClassification`` row: ``base``'s decoder, a ``score`` head [num_labels, hidden]."""
    return dataclasses.replace(base, name=name, base=base.name, programs=frozenset(programs))


_LLAMA = Architecture("LlamaForCausalLM", "llama", qkv_bias=None, qk_norm=False)
_QWEN2 = Architecture("Qwen2ForCausalLM", "qwen2", qkv_bias=True, qk_norm=False, window=WINDOW_FROM_MAX)
_ROWS = (
    _LLAMA,
    Architecture("MistralForCausalLM", "mistral", qkv_bias=False, qk_norm=False, window=WINDOW_ALL),
    _QWEN2,
    Architecture("Qwen3ForCausalLM", "qwen3", qkv_bias=None, qk_norm=True, window=WINDOW_FROM_MAX),
    Architecture("Qwen3MoeForCausalLM", "qwen3_moe", qkv_bias=None, qk_norm=True, window=WINDOW_ALL_IF_USED,
                 moe=MOE_EXPERTS),
    # the trainer's tables have no shared expert
    Architecture("Qwen2MoeForCausalLM", "qwen2_moe", qkv_bias=True, qk_norm=False, window=WINDOW_EVEN_BELOW_MAX,
                 moe=MOE_SHARED, qkv_bias_key="qkv_bias", programs=frozenset({SERVER})),
    # reward models, served on /classify (`megarl.server.reward`)
    _classifier(_LLAMA, "LlamaForSequenceClassification"),
    _classifier(_QWEN2, "Qwen2ForSequenceClassification"),
)
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in _ROWS}


def supported(program: str) -> list[str]:
    """The architectures ``program`` runs, sorted."""
    return sorted(a.name for a in ARCHITECTURES.values() if program in a.programs)


def get_architecture(name, program: str = TRAINER, where: str = "") -> Architecture:
    """The row of ``name`` if ``program`` can run it; else a one-line ValueError that names the
    architecture, the program and (``where``: the config.json path) the file."""
    at = f"{where}: " if where else ""
    arch = ARCHITECTURES.get(name) if isinstance(name, str) else None
    if arch is None:
        others = [n for n in sorted(ARCHITECTURES) if program not in ARCHITECTURES[n].programs]
        by = [p for p in PROGRAMS if p != program and any(p in ARCHITECTURES[n].programs for n in others)]
        also = f" ({', '.join(by)} also runs {', '.join(others)})" if others else ""
        raise ValueError(f"{at}unsupported architecture: architectures[0]={name!r} is not supported; "
                         f"supported: {', '.join(supported(program))}{also}")
    if program not in arch.programs:
        raise ValueError(f"{at}architectures[0]={name!r} is not supported by {program} (only by "
                         f"{', '.join(p for p in PROGRAMS if p in arch.programs)}); {program} runs: "
                         f"{', '.join(supported(program))}")
    return arch
