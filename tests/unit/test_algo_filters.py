"""DAPO dynamic sampling and overlong shaping."""
import pytest
import torch

from megarl.algo import (dynamic_sampling_indices, dynamic_sampling_keep, overlong_penalty,
                         response_lengths, shape_and_filter)


def test_dynamic_sampling_drops_equal_reward_and_single_sample_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 2.0])
    groups = [4, 4, 2, 2, 8, 8, 8, 1]
    expect = []
    for i, g in enumerate(groups):
        members = {float(r) for r, h in zip(rewards, groups) if h == g}
        expect.append(len(members) > 1)
    assert dynamic_sampling_keep(rewards, groups).tolist() == expect == [False, False, True, True,
                                                                         False, False, False, False]
    assert dynamic_sampling_indices(rewards, torch.tensor(groups)).tolist() == [2, 3]


def test_overlong_penalty_is_linear_over_the_buffer():
    lengths = torch.tensor([0, 16, 17, 18, 20, 25])
    got = overlong_penalty(lengths, max_response_len=20, buffer_len=4, penalty_factor=2.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.5, -1.0, -2.0, -2.0]))
    assert not overlong_penalty(lengths, 20, 0).any()
    with pytest.raises(ValueError):
        overlong_penalty(lengths, 20, 21)
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0]])
    assert response_lengths(mask).tolist() == [2, 0]


def test_shape_then_filter_in_dapos_order_by_hand():
    """L_max 8, buffer 4, f 1: R_len = 0, 0, -0.25, -0.5, -0.75, -1 for L = 3, 4, 5, 6, 7, >= 8."""
    raw = torch.tensor([1.0, 1.0, 1.0, 0.5, 0.0, 0.0, 1.0, 0.0])
    lengths = torch.tensor([4, 6, 6, 4, 2, 3, 3, 9])
    groups = [0, 0, 1, 1, 2, 2, 3, 3]
    out = shape_and_filter(raw, lengths, groups, max_response_len=8, buffer_len=4, penalty_factor=1.0,
                           dynamic_sampling=True)
    assert out.penalty.tolist() == [0.0, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0, -1.0]
    assert out.rewards.tolist() == [1.0, 0.5, 0.5, 0.5, 0.0, 0.0, 1.0, -1.0]
    # group 0: equal verifier rewards, the shaping tells them apart -> kept;
    # group 1: different verifier rewards that the shaping makes equal -> dropped;
    # group 2: equal either way -> dropped; group 3: different either way -> kept
    assert out.keep.tolist() == [True, True, False, False, False, False, True, True]
    # the order matters: filtering the raw rewards (what the manager did before) keeps 1, drops 0
    assert dynamic_sampling_keep(raw, groups).tolist() == [False, False, True, True, False, False, True, True]
    # each knob alone
    only_shape = shape_and_filter(raw, lengths, groups, 8, 4, 1.0, dynamic_sampling=False)
    assert only_shape.keep.all() and only_shape.rewards.tolist() == out.rewards.tolist()
    only_filter = shape_and_filter(raw, lengths, groups, 8, 0, 1.0, dynamic_sampling=True)
    assert only_filter.rewards.tolist() == raw.tolist()
    assert only_filter.keep.tolist() == dynamic_sampling_keep(raw, groups).tolist()
