"""TensorBatch: built once from lists or trajectories, indexed without per-token Python;
micro-batches are row slices of the padded tensors."""
from dataclasses import dataclass, field

import pytest
import torch

from megarl.trainer.batch import (TensorBatch, make_microbatches, pad_sequences,
                                  per_sample)

IDS = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]
MASK = [[0, 1, 1], [1], [0, 0, 1, 1, 1], [0, 1]]


def test_pad_sequences_and_per_sample_roundtrip():
    rows = [[1.0, 2.0, 3.0], [4.0], []]
    t = pad_sequences(rows)
    assert t.dtype == torch.float32
    assert t.tolist() == [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert [r.tolist() for r in per_sample(t, [3, 1, 0])] == rows
    assert pad_sequences([[1, 2]], torch.long, seq_len=4).tolist() == [[1, 2, 0, 0]]
    assert pad_sequences([]).shape == (0, 0)


def test_from_lists_pads_once():
    b = TensorBatch.from_lists(IDS, {"loss_mask": MASK}, {"rewards": [1.0, 0.1, 0.0, 2.0],
                                                          "group_ids": [3, 3, 4, 4]})
    assert len(b) == 4 and b.seq_len == 5
    assert b.lengths.tolist() == [3, 1, 5, 2]
    assert b.tokens.dtype == torch.long and b.tokens[1].tolist() == [4, 0, 0, 0, 0]
    assert b["loss_mask"].dtype == torch.float32 and b["loss_mask"][3].tolist() == [0, 1, 0, 0, 0]
    # a reward reaches the advantage estimator as the same double it was in Python
    assert b["rewards"].dtype == torch.float64 and b["rewards"][1].item() == 0.1
    assert b["group_ids"].dtype == torch.long
    assert "loss_mask" in b and "rewards" in b and "values" not in b


def test_from_lists_rejects_misaligned_fields():
    with pytest.raises(ValueError, match="loss_mask"):
        TensorBatch.from_lists(IDS, {"loss_mask": [[1, 1, 1], [1, 1], [1] * 5, [1, 1]]})
    with pytest.raises(ValueError, match="loss_mask"):
        TensorBatch.from_lists(IDS, {"loss_mask": MASK[:3]})
    b = TensorBatch.from_lists(IDS)
    with pytest.raises(ValueError, match="adv"):
        b.with_fields(adv=torch.zeros(4, 3))
    with pytest.raises(ValueError, match="rewards"):
        b.with_sample_fields(rewards=[1.0])


def test_select_trims_padding_and_keeps_order():
    b = TensorBatch.from_lists(IDS, {"loss_mask": MASK}, {"rewards": [0.0, 1.0, 2.0, 3.0]})
    sub = b.select([3, 1])
    assert sub.seq_len == 2 and sub.lengths.tolist() == [2, 1]
    assert sub.tokens.tolist() == [[10, 11], [4, 0]]
    assert sub["loss_mask"].tolist() == [[0, 1], [1, 0]]
    assert sub["rewards"].tolist() == [3.0, 1.0]
    assert len(b.select([])) == 0


def test_with_fields_is_a_new_batch():
    b = TensorBatch.from_lists(IDS, {"loss_mask": MASK})
    c = b.with_fields(adv=torch.ones(4, 5))
    assert "adv" in c and "adv" not in b
    assert c.tokens is b.tokens  # untouched tensors are shared, not copied


@dataclass
class FakeTrajectory:  # duck-typed megarl.protocol.types.Trajectory
    input_ids: list
    loss_mask: list
    behave_logp: list
    versions: list
    reward: float
    group_id: int
    info: dict = field(default_factory=dict)


def test_from_trajectories():
    trajs = [FakeTrajectory([1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.25], [-1, 4, 5], 1.0, 7),
             FakeTrajectory([4, 5], [0, 1], [0.0, -1.0], [-1, 5], 0.0, 7)]
    b = TensorBatch.from_trajectories(trajs)
    assert b.tokens.tolist() == [[1, 2, 3], [4, 5, 0]]
    assert b["behave_logp"].tolist() == [[0.0, -0.5, -0.25], [0.0, -1.0, 0.0]]
    assert b["versions"].tolist() == [[-1, 4, 5], [-1, 5, 0]]
    assert b["rewards"].tolist() == [1.0, 0.0] and b["group_ids"].tolist() == [7, 7]


def test_microbatches_are_row_slices():
    b = TensorBatch.from_lists(IDS, {"loss_mask": MASK})
    mbs = make_microbatches(b, max_tokens=6, device="cpu")
    assert sorted(i for mb in mbs for i in mb.indices.tolist()) == [0, 1, 2, 3]
    for mb in mbs:
        s = mb.tokens.shape[1]
        assert mb.tokens.shape[0] * s <= 6 or len(mb.indices) == 1
        assert s == max(len(IDS[i]) for i in mb.indices.tolist())  # trimmed to its longest row
        assert torch.equal(mb.tokens, b.tokens[mb.indices, :s])
        assert torch.equal(mb["loss_mask"], b["loss_mask"][mb.indices, :s])
        assert mb.position_ids[0].tolist() == list(range(s))
        assert torch.equal(mb.valid.bool(), mb.tokens != 0)  # no token id 0 in IDS
