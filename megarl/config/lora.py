"""The LoRA section (`lora.*`): low-rank adapters on the policy's Megatron linear layers.

With ``lora.rank > 0`` every targeted linear layer W (of every transformer layer) computes
``W x + (alpha / rank) * B A dropout(x)``; W and every other base weight are frozen, the optimizer
holds only A and B, and the weight push sends only the adapters (`megarl.models.lora`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megarl.config.common import _check
from megarl.common.errors import ConfigError
from megarl.common.fields import bounded

# Megatron's names of the linear layers of a dense GPT layer, and the HF modules they hold
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
HF_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
              "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}


def hf_target_modules(targets) -> list[str]:
    """The HF module names (PEFT's target_modules, SGLang's --lora-target-modules) of Megatron ``targets``."""
    return sorted(m for t in targets for m in HF_MODULES[t])


@dataclass
class LoRAConfig:
    rank: int = bounded(0, ge=0)
    """Adapter rank r; 0 = LoRA off (full fine-tuning)."""
    alpha: float = bounded(16.0, gt=0)
    """Scale numerator: the adapter adds (alpha / rank) * B A x."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Megatron linear layers that get adapters: linear_qkv (HF q/k/v_proj), linear_proj (o_proj),
    linear_fc1 (gate/up_proj), linear_fc2 (down_proj). A fused layer shares A between its HF modules."""
    dropout: float = bounded(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training (never on the base path or in logprob passes)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> None:
        _check(self, "lora")
        if not isinstance(self.target_modules, list) or not self.target_modules:
            raise ConfigError(f"lora.target_modules: must be a non-empty list of {', '.join(LORA_TARGETS)}; "
                              f"got {self.target_modules!r}")
        for t in self.target_modules:
            if t not in LORA_TARGETS:
                raise ConfigError(f"lora.target_modules: {t!r} is not a Megatron linear layer; use "
                                  f"{', '.join(LORA_TARGETS)}")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ConfigError(f"lora.target_modules: duplicate entries in {self.target_modules!r}")
