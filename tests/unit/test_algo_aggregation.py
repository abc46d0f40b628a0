"""Loss aggregation: every mode against a loop reference, independent of micro-batch/DP split."""
import pytest
import torch

from megarl.algo import (LossAgg, StepDenominators, aggregate, step_denominators,
                         step_token_weights, token_weights)

D = torch.float64
NORM = 7


def _ref(loss, mask, mode):
    rows = [(l, m) for l, m in zip(loss.tolist(), mask.tolist())]
    n_tok = sum(sum(m) for _, m in rows)
    sums = [sum(x * y for x, y in zip(l, m)) for l, m in rows if sum(m) > 0]
    lens = [sum(m) for _, m in rows if sum(m) > 0]
    if mode == LossAgg.TOKEN_MEAN:
        return sum(sums) / n_tok
    if mode == LossAgg.SEQ_MEAN_TOKEN_MEAN:
        return sum(s / n for s, n in zip(sums, lens)) / len(sums)
    if mode == LossAgg.SEQ_MEAN_TOKEN_SUM:
        return sum(sums) / len(sums)
    return sum(s / NORM for s in sums) / len(sums)


def _batch(seed=0, b=6, s=5):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(b, s, generator=g, dtype=D)
    mask = (torch.rand(b, s, generator=g) > 0.4).to(D)
    mask[2] = 0.0                                     # all-masked row: not a sequence
    mask[0] = 1.0
    loss[2, 1] = float("inf")                         # must never leak through a zero weight
    return loss, mask


@pytest.mark.parametrize("mode", list(LossAgg))
def test_whole_batch_matches_loop_reference(mode):
    loss, mask = _batch()
    got = aggregate(loss, step_token_weights(mask, mode, norm_len=NORM))
    assert float(got) == pytest.approx(_ref(loss, mask, mode), rel=1e-12)


@pytest.mark.parametrize("mode", list(LossAgg))
@pytest.mark.parametrize("splits", [[1, 1, 1, 1, 1, 1], [2, 4], [3, 3], [5, 1]])
def test_micro_batches_and_dp_ranks_sum_to_the_whole_batch_loss_and_grad(mode, splits):
    loss0, mask = _batch(seed=1)
    ref = _ref(loss0, mask, mode)
    # DP: two ranks with rows [0, 3) and [3, 6); each reduces its local denominators, all-reduce.
    ranks = [slice(0, 3), slice(3, 6)]
    denoms = [step_denominators(mask[r]) for r in ranks]
    total = StepDenominators.from_tensor(sum(d.as_tensor() for d in denoms))
    param = loss0.clone().requires_grad_(True)
    step_loss = torch.zeros((), dtype=D)
    for r in ranks:
        w_rank = token_weights(mask[r], mode, total, norm_len=NORM)
        rows = torch.arange(r.start, r.stop)
        for chunk in torch.split(rows, splits[0]):                  # micro-batches of the rank
            local = chunk - r.start
            mb = aggregate(param[chunk], w_rank[local])
            mb.backward()
            step_loss = step_loss + mb.detach()
    assert float(step_loss) == pytest.approx(ref, rel=1e-12)
    whole = loss0.clone().requires_grad_(True)
    aggregate(whole, step_token_weights(mask, mode, norm_len=NORM)).backward()
    torch.testing.assert_close(param.grad, whole.grad, rtol=1e-12, atol=1e-15)

    # Plain micro-batch split on one rank with the listed sizes.
    w = step_token_weights(mask, mode, norm_len=NORM)
    parts = [aggregate(l, ww) for l, ww in zip(torch.split(loss0, splits), torch.split(w, splits))]
    assert float(sum(parts)) == pytest.approx(ref, rel=1e-12)


def test_hand_numbers_and_denominators():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=D)
    d = step_denominators(mask)
    assert float(d.num_tokens) == 4 and float(d.num_seqs) == 2
    cases = {LossAgg.TOKEN_MEAN: 10 / 4, LossAgg.SEQ_MEAN_TOKEN_MEAN: (2 + 4) / 2,
             LossAgg.SEQ_MEAN_TOKEN_SUM: (6 + 4) / 2, LossAgg.SEQ_MEAN_TOKEN_SUM_NORM: (6 + 4) / 2 / 4}
    for mode, value in cases.items():
        assert float(aggregate(loss, step_token_weights(mask, mode, norm_len=4))) == pytest.approx(value)


def test_empty_step_gives_zero_weights_and_missing_norm_len_raises():
    mask = torch.zeros(2, 3)
    for mode in LossAgg:
        w = step_token_weights(mask, mode, norm_len=3)
        assert w.dtype == torch.float32 and not w.any()
    with pytest.raises(ValueError, match="norm_len"):
        step_token_weights(torch.ones(1, 2), LossAgg.SEQ_MEAN_TOKEN_SUM_NORM)
