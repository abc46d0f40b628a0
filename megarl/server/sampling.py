"""Batched token sampling for the rollout engine: one set of tensor ops for the whole batch.

Reported logprob (`behave_logp`, what the trainer recomputes): ``log_softmax(logits / T)[token]``
over the fp32 logits at the request's temperature T (1 for a greedy row), before any top-k / top-p
/ min-p transformation - what SGLang reports by default, and the distribution the trainer scores
(`megarl.trainer.engine.EngineSpec.temperature`). The *choice* of token uses the transformed one:

    z = logits / temperature;  top-k keeps the k largest z;  p = softmax(z);
    min-p drops p_i < min_p * max(p);  top-p keeps the smallest prefix (by p, descending) whose
    mass reaches top_p;  token = inverse-CDF(p, u)        (temperature 0 -> argmax of logits)

Randomness is one uniform u per row. For a request with a ``seed`` it is a hash of
(seed, absolute position of the token), so a request is reproducible regardless of batch
composition and a resubmitted request (prompt + tokens so far) continues the same stream.
Rows without a seed draw u from the server's torch generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

_MASK64 = (1 << 64) - 1


def seeded_uniform(seed: int, position: int) -> float:
    """splitmix64(seed, position) -> float in [0, 1) with 53 random bits."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


@dataclass(frozen=True)
class SamplingConfig:
    """Validated per-sample sampling parameters (SGLang names)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: off
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: Optional[int] = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


class BatchSampler:
    """Builds the per-row parameter tensors once per step and samples the whole batch."""

    def __init__(self, generator: Optional[torch.Generator] = None):
        self.generator = generator

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, params: list[SamplingConfig], positions: list[int]
    ) -> tuple[list[int], list[float]]:
        """logits fp32 [B, V]; positions[b] = absolute index the sampled token will occupy."""
        greedy = [p.greedy for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        if all(t == 1.0 for t in temps):
            z = logits
        else:
            z = logits / torch.tensor(temps, dtype=logits.dtype, device=logits.device).unsqueeze(1)
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample_stochastic(z, params, positions, greedy)
        logp = z.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(z, dim=-1)
        return tokens.tolist(), logp.tolist()

    def _sample_stochastic(self, z, params, positions, greedy):
        """z = logits / temperature (greedy rows: the logits themselves, argmax taken)."""
        B, V = z.shape
        dev, argmax = z.device, z.argmax(dim=-1) if any(greedy) else None
        ks = [p.top_k if (p.top_k > 0 and not g) else 0 for p, g in zip(params, greedy)]
        if any(ks):
            kmax = min(max(ks), V)
            top = torch.topk(z, kmax, dim=-1).values
            kidx = torch.tensor([min(k, kmax) - 1 if k > 0 else kmax - 1 for k in ks], device=dev)
            thresh = top.gather(1, kidx.unsqueeze(1))
            off = torch.tensor([k == 0 for k in ks], device=dev).unsqueeze(1)
            z = z.masked_fill((z < thresh) & ~off, float("-inf"))
        probs = torch.softmax(z, dim=-1)
        min_ps = [p.min_p for p in params]
        if any(m > 0 for m in min_ps):
            m = torch.tensor(min_ps, dtype=probs.dtype, device=probs.device).unsqueeze(1)
            probs = probs.masked_fill(probs < m * probs.max(dim=-1, keepdim=True).values, 0.0)
        top_ps = [p.top_p for p in params]
        if any(tp < 1.0 for tp in top_ps):
            probs = _top_p_filter(probs, top_ps)
        cdf = probs.cumsum(dim=-1)
        u = self._uniforms(params, positions).to(cdf.device)
        target = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
        tokens = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=V - 1)
        if any(greedy):
            tokens = torch.where(torch.tensor(greedy, device=dev), argmax, tokens)
        return tokens

    def _uniforms(self, params, positions) -> torch.Tensor:
        u = torch.rand(len(params), generator=self.generator, dtype=torch.float64)
        for i, (p, pos) in enumerate(zip(params, positions)):
            if p.seed is not None:
                u[i] = seeded_uniform(p.seed, pos)
        return u


def _top_p_filter(probs: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Zero the tail of each row beyond the smallest prefix holding `top_p` of the mass."""
    rows = [i for i, tp in enumerate(top_ps) if tp < 1.0]
    sub = probs[rows]
    sorted_p, idx = sub.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly before each entry
    tp = torch.tensor([top_ps[i] for i in rows], dtype=probs.dtype, device=probs.device).unsqueeze(1)
    sorted_p = sorted_p.masked_fill(before >= tp, 0.0)  # the first entry always survives
    out = probs.clone()
    out[rows] = torch.zeros_like(sub).scatter_(1, idx, sorted_p)
    return out
