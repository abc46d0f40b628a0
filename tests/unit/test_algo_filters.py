"""DAPO dynamic sampling and overlong shaping."""
import pytest
import torch

from megarl.algo import (dynamic_sampling_indices, dynamic_sampling_keep, overlong_penalty,
                         response_lengths)


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
