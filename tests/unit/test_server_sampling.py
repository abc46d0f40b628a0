"""BatchSampler: reported logprobs are log-softmax at the row's temperature (SGLang's default),
before top-k / top-p / min-p; filters and seeds behave per row."""

from __future__ import annotations

import torch

from megarl.server.sampling import BatchSampler, SamplingConfig, seeded_uniform


def _logits(B=6, V=50, seed=0):
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_logprob_is_log_softmax_at_the_temperature_whatever_the_filters():
    logits = _logits()
    params = [SamplingConfig(temperature=0.0), SamplingConfig(temperature=0.5, seed=1),
              SamplingConfig(top_p=0.3, seed=2), SamplingConfig(top_k=3, seed=3),
              SamplingConfig(min_p=0.2, seed=4), SamplingConfig(temperature=2.0, top_k=10, top_p=0.9, seed=5)]
    toks, lps = BatchSampler().sample(logits, params, [7] * 6)
    temps = torch.tensor([1.0, 0.5, 1.0, 1.0, 1.0, 2.0], dtype=torch.float64)  # greedy: temperature 1
    ref = torch.log_softmax(logits.double() / temps[:, None], -1)
    raw = torch.log_softmax(logits.double(), -1)
    for b, (t, lp) in enumerate(zip(toks, lps)):
        assert abs(lp - ref[b, t].item()) < 1e-5
    assert toks[0] == int(logits[0].argmax())
    # the tempered rows differ from the raw logprob by far more than the tolerance
    assert abs(lps[1] - raw[1, toks[1]].item()) > 1e-3 and abs(lps[5] - raw[5, toks[5]].item()) > 1e-3


def test_greedy_top_k_1_and_tiny_top_p_pick_the_argmax():
    logits = _logits(B=3)
    params = [SamplingConfig(temperature=0.0), SamplingConfig(top_k=1, seed=9), SamplingConfig(top_p=1e-6, seed=9)]
    toks, _ = BatchSampler().sample(logits, params, [0, 0, 0])
    assert toks == logits.argmax(-1).tolist()


def test_filters_restrict_the_support():
    logits = _logits(B=1, V=40, seed=1).expand(400, 40).contiguous()
    probs = torch.softmax(logits[0], -1)
    top5 = set(torch.topk(logits[0], 5).indices.tolist())
    s = BatchSampler(torch.Generator().manual_seed(0))
    toks, _ = s.sample(logits, [SamplingConfig(top_k=5)] * 400, list(range(400)))
    assert set(toks) <= top5 and len(set(toks)) > 1
    order = probs.argsort(descending=True).tolist()
    mass, nucleus = 0.0, set()
    for i in order:  # smallest prefix reaching 0.5
        nucleus.add(i)
        mass += probs[i].item()
        if mass >= 0.5:
            break
    toks, _ = s.sample(logits, [SamplingConfig(top_p=0.5)] * 400, list(range(400)))
    assert set(toks) <= nucleus
    keep = {i for i in range(40) if probs[i] >= 0.3 * probs.max()}
    toks, _ = s.sample(logits, [SamplingConfig(min_p=0.3)] * 400, list(range(400)))
    assert set(toks) <= keep


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).expand(4000, 4).contiguous()
    toks, _ = BatchSampler(torch.Generator().manual_seed(0)).sample(
        logits, [SamplingConfig()] * 4000, [0] * 4000)
    freq = torch.bincount(torch.tensor(toks), minlength=4).double() / 4000
    assert torch.allclose(freq, torch.softmax(logits[0].double(), -1), atol=0.03)


def test_seeded_rows_are_reproducible_and_independent_of_the_batch():
    logits = _logits(B=4)
    p = SamplingConfig(seed=42)
    a, _ = BatchSampler().sample(logits, [p, SamplingConfig(), p, SamplingConfig()], [5, 5, 5, 5])
    b, _ = BatchSampler().sample(logits[2:3], [p], [5])
    assert a[2] == b[0]
    assert seeded_uniform(1, 2) == seeded_uniform(1, 2) != seeded_uniform(1, 3)
    us = [seeded_uniform(7, i) for i in range(2000)]
    assert all(0 <= u < 1 for u in us) and abs(sum(us) / len(us) - 0.5) < 0.03
