"""Tiny random HF models for the parity tests (test_parity_convert, test_moe, test_routing_replay;
tests/unit's server parity tests import it too: tests/conftest.py puts this tier on sys.path): built WITH
transformers from a config, weights moved away from the init's ones/zeros so norms and biases
matter, saved as safetensors; transformers' own fp32 per-token logprobs as the reference; a
directory's safetensors shards read back into one dict."""
import os

import torch
from safetensors.torch import load_file


def save_random(transformers, cfg, out: str, seed: int):
    """A model of `cfg` with perturbed weights, saved to `out`; returned in eval mode."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.08))
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    return model


def reference_logprobs(model, rows) -> list[list[float]]:
    """Per-token logprobs of each row (0.0 for the first token, as megarl-logprobs writes them)."""
    out = []
    with torch.no_grad():
        for ids in rows:
            logits = model(torch.tensor([ids])).logits[0].float()
            lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
            out.append([0.0] + lp.tolist())
    return out


def load_safetensors(d) -> dict:
    out = {}
    for name in sorted(os.listdir(d)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, name)))
    return out
