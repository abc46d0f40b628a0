"""Tiny random HF checkpoints (config.json + safetensors) for tests, benchmarks and demos."""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
from safetensors.torch import save_file

from megarl.models.layouts import hf_shapes
from megarl.protocol.hf_model import ARCHITECTURES, read_model_args

TINY = {
    "LlamaForCausalLM": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "Qwen2ForCausalLM": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen3ForCausalLM": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                             head_dim=32),
    "MistralForCausalLM": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                               sliding_window=None),
    "Qwen3MoeForCausalLM": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                head_dim=16, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32, norm_topk_prob=True),
}


def tiny_config(arch: str = "LlamaForCausalLM", **overrides) -> dict:
    cfg = {
        "architectures": [arch], "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 4,
        "intermediate_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "initializer_range": 0.02, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2,
        "model_type": ARCHITECTURES[arch].model_type if arch in ARCHITECTURES else "llama",
    }
    cfg.update(TINY.get(arch, {}))
    cfg.update(overrides)
    return cfg


def write_random_hf(out_dir: str, config: dict, seed: int = 0, std: float = 0.05,
                    dtype: torch.dtype = torch.float32, tensors: Optional[dict] = None) -> str:
    """Writes ``config`` and random weights for every tensor of its architecture's table."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    args = read_model_args(out_dir)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in hf_shapes(args).items():  # table order: the draws depend on it
        if "norm" in name:  # norms near 1 so activations stay in range
            out[name] = (1.0 + 0.1 * torch.randn(shape, generator=g)).to(dtype)
        else:
            out[name] = (std * torch.randn(shape, generator=g)).to(dtype)
    out.update(tensors or {})
    save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir
