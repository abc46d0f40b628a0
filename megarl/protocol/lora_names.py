"""What a LoRA push names, for the trainer that sends it (`megarl.models.lora`) and the server
that merges it (`megarl.server.lora`): per adapted HF module ``M`` (e.g.
``model.layers.0.self_attn.q_proj``) the PEFT pair ``M.lora_A.weight`` [r, in] and
``M.lora_B.weight`` [out, r], and the scale ``lora.scaling`` (alpha / r, one float32) the servers
merge with (W = W0 + scaling * B @ A into ``M.weight``)."""
from __future__ import annotations

SCALING = "lora.scaling"
A_SUFFIX, B_SUFFIX = ".lora_A.weight", ".lora_B.weight"


def adapter_names(module: str) -> tuple[str, str]:
    """The A and B tensor names of HF module ``module``."""
    return module + A_SUFFIX, module + B_SUFFIX


def is_lora_name(name: str) -> bool:
    return name == SCALING or name.endswith((A_SUFFIX, B_SUFFIX))


def module_of(name: str) -> str:
    """The HF module an A or B tensor adapts (``M.lora_A.weight`` -> ``M``)."""
    for suffix in (A_SUFFIX, B_SUFFIX):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    raise ValueError(f"{name}: not a LoRA adapter tensor (…{A_SUFFIX} or …{B_SUFFIX})")


def base_name(name: str) -> str:
    """The base weight an adapter tensor changes (``M.lora_A.weight`` -> ``M.weight``)."""
    return module_of(name) + ".weight"
