"""Pure parts of the actor and critic: mini-batch planning, step-level advantages, the loss
function's composition and the loglinear clock, the clipped value loss."""
import math
from types import SimpleNamespace

import pytest
import torch

from megarl.algo import AdvantageConfig, AdvantageEstimator
from megarl.config import Config
from megarl.trainer.metrics import StatsTracker
from megarl.trainer.actor import (Actor, _Clock, minibatch_indices, num_minibatches,
                                  shuffle_seed)
from megarl.trainer.actor import step_advantages as _advantages
from megarl.trainer.batch import MicroBatch, TensorBatch, per_sample
from megarl.trainer.critic import value_loss


# ----------------------------------------------------------------------------- mini-batches

@pytest.mark.parametrize("counts,size,expected", [
    ([3, 3, 2], 4, 2),   # 8 sequences / 4 = 2
    ([5, 5], 3, 4),      # ceil(10 / 3) = 4
    ([1, 4], 2, 1),      # ceil(5 / 2) = 3, but one rank holds a single sequence
    ([4, 4], 0, 1),      # 0 = the whole step
    ([4, 4], 100, 1),    # larger than the step
    ([0, 3], 1, 0),      # a rank without data: no update
])
def test_num_minibatches(counts, size, expected):
    assert num_minibatches(counts, size) == expected


def test_minibatch_indices_partition_and_determinism():
    parts = minibatch_indices(7, 3, seed=11)
    assert [len(p) for p in parts] == [3, 2, 2]
    assert sorted(i for p in parts for i in p) == list(range(7))
    assert all(p == sorted(p) for p in parts)
    assert minibatch_indices(7, 3, seed=11) == parts  # every TP/PP peer draws the same split
    assert any(minibatch_indices(7, 3, seed=s) != parts for s in range(12, 20))
    assert minibatch_indices(4, 1, seed=0) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError):
        minibatch_indices(2, 3, seed=0)


def test_shuffle_seed_differs_per_epoch_and_update():
    seeds = {shuffle_seed(1234, u, e) for u in range(3) for e in range(3)}
    assert len(seeds) == 9


# ----------------------------------------------------------------------------- advantages

MASK = [[0, 1, 1], [0, 0, 1], [0, 1, 1, 1], [0, 1]]
REWARDS = [1.0, 0.0, 2.0, 2.0]
GROUPS = [7, 7, 9, 9]


def step(mask=MASK, rewards=REWARDS, groups=GROUPS, **fields):
    return TensorBatch.from_lists([[5] * len(m) for m in mask], {"loss_mask": mask, **fields},
                                  {"rewards": rewards, "group_ids": groups})


def step_advantages(cfg, batch, kl=None):
    """The batch plus advantages and returns (what `Actor.step_fields` adds)."""
    out = _advantages(cfg, batch, batch.fields.get("values"), kl)
    return batch.with_fields(advantages=out.advantages, returns=out.returns)


def rows(batch, name):
    return [t.tolist() for t in per_sample(batch[name], batch.lengths)]


def test_step_advantages_grpo_by_hand():
    out = step_advantages(AdvantageConfig(), step())
    # group 7: mean 0.5, unbiased std sqrt(0.5); group 9: equal rewards -> 0
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    expected = [[0, a, a], [0, 0, -a], [0, 0, 0, 0], [0, 0]]
    for got, exp in zip(rows(out, "advantages"), expected):
        assert got == pytest.approx(exp, abs=1e-6)
    assert [len(r) for r in rows(out, "advantages")] == [3, 3, 4, 2]
    assert rows(out, "returns") == [[0, 1, 1], [0, 0, 0], [0, 2, 2, 2], [0, 2]]
    assert out["advantages"][3, 2:].tolist() == [0, 0]  # padding stays 0


def test_step_advantages_drgrpo_with_kl_in_reward():
    cfg = AdvantageConfig(estimator=AdvantageEstimator.DRGRPO, kl_coef=0.5)
    kl = [[9.0, 0.2, 0.2], [9.0, 9.0, 0.0], [0, 0, 0, 0], [0, 0]]  # off-mask entries ignored
    batch = step(kl=kl)
    out = step_advantages(cfg, batch, kl=batch["kl"])
    # scores: 1 - 0.5 * 0.4 = 0.8 and 0.0; group mean 0.4
    assert rows(out, "advantages")[0] == pytest.approx([0, 0.4, 0.4])
    assert rows(out, "advantages")[1] == pytest.approx([0, 0, -0.4])


def test_step_advantages_gae_by_hand():
    cfg = AdvantageConfig(estimator=AdvantageEstimator.GAE, norm_adv_by_std=False)
    out = step_advantages(cfg, step([[0, 1, 1]], [1.0], [0], values=[[0.0, 0.5, 0.2]]))
    # t=2: delta = 1 - 0.2 = 0.8; t=1: delta = 0.2 - 0.5 = -0.3, A = -0.3 + 0.8 = 0.5
    assert rows(out, "advantages")[0] == pytest.approx([0, 0.5, 0.8])
    assert rows(out, "returns")[0] == pytest.approx([0, 1.0, 1.0])


def test_step_fields_kl_in_reward_one_rank():
    """DP = 1: the gathered step is this batch; ref_logp comes from the reference engine and the
    KL (k1 of behave vs ref) is folded into the drgrpo score before the group baseline."""
    cfg = Config()
    cfg.algo.advantage, cfg.algo.kl_in_reward, cfg.algo.kl_coef = "drgrpo", True, 0.5
    cfg.algo.kl_estimator = "k1"
    ref = torch.tensor([[0.0, -1.2, -1.2, 0.0], [0.0, 0.0, -1.0, 0.0],
                        [0.0, -1.0, -1.0, -1.0], [0.0, -1.0, 0.0, 0.0]])
    ref_engine = SimpleNamespace(compute_logp=lambda b: SimpleNamespace(logp=ref[:, :b.seq_len]))
    actor = Actor(cfg, SimpleNamespace(dp=1, dp_rank=0), engine=None, ref=ref_engine)
    behave = [[0.0, -1.0, -1.0], [0.0, 0.0, -1.0], [0.0, -1.0, -1.0, -1.0], [0.0, -1.0]]
    out, _ = actor.step_fields(step(behave_logp=behave), version=0, update=False)
    # k1 = behave - ref = 0.2 on both loss tokens of row 0: score 1 - 0.5 * 0.4 = 0.8 vs 0.0
    assert rows(out, "advantages")[0] == pytest.approx([0, 0.4, 0.4])
    assert rows(out, "advantages")[1] == pytest.approx([0, 0, -0.4])
    assert torch.equal(out["ref_logp"], ref)
    with pytest.raises(ValueError, match="group_ids"):
        actor.step_fields(TensorBatch.from_lists([[1]], {"loss_mask": [[1]]},
                                                 {"rewards": [1.0]}), version=0)


# ----------------------------------------------------------------------------- the loss function

def micro_batch(fields, step_tokens):
    b, s = fields["loss_mask"].shape
    return MicroBatch(torch.zeros(b, s, dtype=torch.long), torch.zeros(b, s, dtype=torch.long),
                      fields, torch.full((b,), s), torch.arange(b), step_tokens)


def test_loss_fn_composes_policy_entropy_and_kl():
    cfg = Config()
    cfg.algo.entropy_coef, cfg.algo.kl_coef = 0.1, 0.2
    actor = Actor(cfg, ps=None, engine=None)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    logp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    w = torch.tensor([[0.0, 0.25, 0.25]])  # half of a 4-token mini-batch
    fields = {"loss_mask": mask, "behave_logp": logp.detach().clone(),
              "prox_logp": logp.detach().clone(), "ref_logp": logp.detach().clone(),
              "advantages": torch.tensor([[0.0, 2.0, -1.0]]), "loss_weight": w}
    entropy = torch.tensor([[0.0, 3.0, 1.0]])
    acc = StatsTracker()
    loss, extra = actor._loss_fn(_Clock(), acc, logp, entropy, micro_batch(fields, 4.0))
    assert extra == {}
    # pi_theta = pi_prox = pi_behave = pi_ref: per-token -A - 0.1 H + 0, weighted by W
    assert float(loss) == pytest.approx(0.25 * (-2.0 - 0.3) + 0.25 * (1.0 - 0.1))
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, -0.5, 0.25])  # -A W (k3 has zero slope)
    s = acc.stats
    assert float(s["pg_loss"].value) == pytest.approx(0.25 * (-2.0 + 1.0))
    assert float(s["pg_loss"].count) == pytest.approx(0.5)  # 2 of the mini-batch's 4 tokens
    assert s["entropy"].result() == pytest.approx(2.0)
    assert s["kl_ref"].result() == 0.0 and s["logp_gap"].result() == 0.0


def test_loss_fn_loglinear_clock():
    cfg = Config()
    cfg.algo.prox_logp_mode = "loglinear"
    cfg.algo.behave_weight_cap = None
    actor = Actor(cfg, ps=None, engine=None)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    logp = torch.tensor([[0.0, -1.0, -1.0]])
    behave = torch.tensor([[0.0, -1.6, -1.3]])
    fields = {"loss_mask": mask, "behave_logp": behave, "advantages": torch.ones(1, 3),
              "versions": torch.tensor([[-1.0, 2.0, 3.0]]), "loss_weight": mask / 2}
    acc = StatsTracker()
    # optimizer step 1 of 2 from version 3: v_theta = 3.5; token 1 (v=2): alpha = 1 / 1.5;
    # token 2 (v=3): alpha = 0 -> pi_prox = pi_behave, behaviour weight 1
    actor._loss_fn(_Clock(k=1, total=2, prox_version=3.0), acc, logp, None,
                   micro_batch(fields, 2.0))
    w1 = math.exp((2 / 3) * 0.6)
    assert acc.stats["behave_weight"].result() == pytest.approx((w1 + 1.0) / 2, rel=1e-6)
    assert acc.stats["behave_weight_max"].result() == pytest.approx(w1, rel=1e-6)
    assert "logp_gap" not in acc.stats  # only the first optimizer step reports the gap


# ----------------------------------------------------------------------------- critic

def test_value_loss_by_hand():
    v = torch.tensor([[0.5, 2.0, 7.0]], requires_grad=True)
    old, ret = torch.zeros(1, 3), torch.ones(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = value_loss(v, old, ret, mask, clip=0.2)
    # token 0: (0.5-1)^2 = 0.25 vs clipped (0.2-1)^2 = 0.64 -> 0.32 (clip active)
    # token 1: (2-1)^2 = 1 vs clipped 0.64 -> 0.5; token 2 off the mask
    assert loss[0].tolist() == pytest.approx([0.32, 0.5, 0.0])
    assert stats["value_clip_frac"].result() == pytest.approx(0.5)
    assert stats["value_abs_err"].result() == pytest.approx(0.75)
    loss.sum().backward()
    assert v.grad[0].tolist() == pytest.approx([0.0, 1.0, 0.0])  # the clipped branch is flat
    unclipped, _ = value_loss(v.detach(), old, ret, mask, clip=None)
    assert unclipped[0].tolist() == pytest.approx([0.125, 0.5, 0.0])
