"""Vocab-parallel logprobs / entropy over a padded vocabulary equal the unpadded model's, with the
padding's logits masked (and no NaN in the gradients). TP shards are simulated by threads whose
all-reduces meet at a barrier (the function only calls dist.all_reduce)."""
import threading

import pytest
import torch

from megarl.trainer import logits as L


def reference(z: torch.Tensor, targets: torch.Tensor):
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


class FakeTP:
    """all_reduce (SUM or MAX) across ``tp`` threads, in call order."""

    def __init__(self, tp: int):
        self.tp, self.barrier, self.slots = tp, threading.Barrier(tp), {}
        self.local = threading.local()

    def all_reduce(self, x, op=None, group=None):
        rank = self.local.rank
        self.slots[rank] = x.detach().clone()
        self.barrier.wait()
        stack = torch.stack([self.slots[r] for r in range(self.tp)])
        out = stack.max(0).values if op is torch.distributed.ReduceOp.MAX else stack.sum(0)
        self.barrier.wait()
        x.copy_(out)


def run_sharded(padded: torch.Tensor, targets, tp: int, vocab: int, monkeypatch):
    fake = FakeTP(tp)
    monkeypatch.setattr(L.dist, "all_reduce", fake.all_reduce)
    shards = [s.clone().requires_grad_(True) for s in padded.chunk(tp, dim=-1)]
    out = [None] * tp

    def work(rank):
        fake.local.rank = rank
        logp, ent = L.vocab_parallel_logprobs(shards[rank], targets, None, tp, rank, True, vocab)
        (logp.sum() + 0.5 * ent.sum()).backward()
        out[rank] = (logp.detach(), ent.detach())

    threads = [threading.Thread(target=work, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, torch.cat([s.grad for s in shards], dim=-1)


@pytest.mark.parametrize("tp, padded_vocab", [(1, 384), (2, 512), (8, 1024)])  # tp=8: 5 shards of padding only
def test_padded_vocab_matches_unpadded(tp, padded_vocab, monkeypatch):
    vocab = 333
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 5, vocab, generator=g) * 3
    junk = torch.randn(2, 5, padded_vocab - vocab, generator=g) * 50 + 100  # would dominate if seen
    padded = torch.cat([z, junk], dim=-1)
    targets = torch.randint(0, vocab, (2, 5), generator=g)
    targets[0, 0] = vocab - 1  # the last real id, on the shard where the padding starts
    ref_z = z.clone().requires_grad_(True)
    ref_logp, ref_ent = reference(ref_z, targets)
    (ref_logp.sum() + 0.5 * ref_ent.sum()).backward()
    out, grad = run_sharded(padded, targets, tp, vocab, monkeypatch)
    for logp, ent in out:  # every TP rank holds the full result
        assert torch.allclose(logp, ref_logp.detach(), atol=1e-5)
        assert torch.allclose(ent, ref_ent.detach(), atol=1e-5)
    assert torch.isfinite(grad).all()
    assert torch.allclose(grad[..., :vocab], ref_z.grad, atol=1e-5)
    assert not grad[..., vocab:].any()  # the padding gets no gradient


def test_tp1_logprobs_without_entropy_use_the_fused_path_and_agree():
    """TP=1 without entropy takes one logsumexp; same values and gradients as the reference,
    padding masked and gradient-free."""
    vocab, padded_vocab = 333, 384
    g = torch.Generator().manual_seed(1)
    z = torch.randn(3, 6, vocab, generator=g) * 3
    junk = torch.randn(3, 6, padded_vocab - vocab, generator=g) * 50 + 100
    targets = torch.randint(0, vocab, (3, 6), generator=g)
    padded = torch.cat([z, junk], dim=-1).requires_grad_(True)
    logp, ent = L.vocab_parallel_logprobs(padded, targets, None, 1, 0, False, vocab)
    assert ent is None
    ref_z = z.clone().requires_grad_(True)
    ref_logp, _ = reference(ref_z, targets)
    assert torch.allclose(logp, ref_logp, atol=1e-6)
    (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
    (ref_logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
    assert torch.allclose(padded.grad[..., :vocab], ref_z.grad, atol=1e-6)
    assert not padded.grad[..., vocab:].any()
