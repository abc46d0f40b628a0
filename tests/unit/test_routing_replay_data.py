"""MoE routes on their way from a /generate response to the trainer's micro-batches: TokenTrace
places them token-aligned (earlier turns kept), the manager's flat arrays carry
them to each DP rank's share, TensorBatch pads / selects / micro-batches them with their rows, `Routes.coverage` counts
them; the config field and its checks."""
import numpy as np
import pytest
import torch

from megarl.config.moe import MoEConfig
from megarl.rollout.manager import pack_batch
from megarl.protocol.types import ModelResponse, RoutedExperts, Trajectory
from megarl.rollout.workflows.base import TokenTrace
from megarl.trainer.batch import TensorBatch, make_microbatches
from megarl.trainer.handoff import receive_step

L, K = 3, 2


def rows(start: int, n: int) -> RoutedExperts:
    """n rows whose ids encode their position (start + j) and weights (start + j) / 100."""
    pos = np.arange(start, start + n)
    ids = np.broadcast_to(pos[:, None, None] % 7, (n, L, K)).astype(np.int32).copy()
    return RoutedExperts(ids, np.broadcast_to(pos[:, None, None] / 100, (n, L, K)).astype(np.float32).copy())


def response(prompt, out, routes) -> ModelResponse:
    return ModelResponse(list(prompt), list(out), [-0.5] * len(out), [3] * len(out), routed_experts=routes)


def test_single_turn_routes_are_token_aligned():
    trace = TokenTrace([5, 6, 7])
    trace.add_generated(response([5, 6, 7], [8, 9], rows(0, 4)))  # server rows: prompt + output - 1
    t = trace.to_trajectory(1.0, 0, {})
    assert t.routes.ids.shape == (5, L, K)
    assert t.routes.ids[:4, 0, 0].tolist() == [0, 1, 2, 3] and (t.routes.ids[4] == -1).all()
    assert t.routes.weights[3, 2, 1] == pytest.approx(0.03) and np.isnan(t.routes.weights[4]).all()


def test_second_turn_keeps_the_first_turns_rows_and_pads_context():
    trace = TokenTrace([5, 6])
    trace.add_generated(response([5, 6], [7], rows(0, 2)))
    trace.add_context([11, 12])
    # turn 2 sends the whole trace; its rows recompute the prefix (offset 50: other values)
    trace.add_generated(response([5, 6, 7, 11, 12], [13, 14], rows(50, 6)))
    trace.add_context([15])
    t = trace.to_trajectory(0.0, 1, {})
    assert t.routes.ids[:, 0, 0].tolist() == [0, 1, 52 % 7, 53 % 7, 54 % 7, 55 % 7, -1, -1]
    assert t.routes.weights[2, 0, 0] == pytest.approx(0.52)


def test_ids_only_server_leaves_nan_weights():
    trace = TokenTrace([1, 2])
    trace.add_generated(response([1, 2], [3, 4], RoutedExperts(rows(0, 3).ids, None)))
    t = trace.to_trajectory(0.0, 0, {})
    assert t.routes.ids[:3, 0, 0].tolist() == [0, 1, 2] and np.isnan(t.routes.weights).all()


def test_trajectory_rejects_misaligned_routes():
    with pytest.raises(ValueError, match="routes"):
        Trajectory([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [-1, 0, 0], 1.0, 0, {}, rows(0, 2))


def traj(n: int, start: int, group: int) -> Trajectory:
    r = rows(start, n)
    r.ids[-1], r.weights[-1] = -1, np.nan
    return Trajectory(list(range(1, n + 1)), [0] + [1] * (n - 1), [0.0] + [-0.25] * (n - 1), [-1] + [0] * (n - 1),
                      float(group), group, {}, r)


class _PS:
    world_size, rank, dp, dp_rank = 1, 0, 1, 0


def test_channel_arrays_carry_routes_to_the_batch_and_micro_batches():
    trajs = [traj(4, 0, 0), traj(7, 10, 1), traj(2, 20, 2)]
    batch = pack_batch(trajs, 1, {}, [])
    assert batch.arrays["route_ids"].shape == (13, L, K) and batch.arrays["route_ids"].dtype == np.int32
    assert batch.arrays["route_weights"].dtype == np.float32
    tb = receive_step(batch, _PS()).share(0)
    assert tb.routes.ids.shape == (3, 7, L, K)
    assert tb.routes.ids[1, :, 0, 0].tolist() == [10 % 7, 11 % 7, 12 % 7, 13 % 7, 14 % 7, 15 % 7, -1]
    assert tb.routes.ids[0, 3:, 0, 0].tolist() == [-1] * 4  # the last position and padding
    assert torch.isnan(tb.routes.weights[2, 1:]).all()
    sub = tb.select([2, 0])
    assert sub.routes.ids.shape == (2, 4, L, K) and torch.equal(sub.routes.ids[1], tb.routes.ids[0, :4])
    mbs = make_microbatches(tb, 8, "cpu")  # rows go to different micro-batches with their routes
    for mb in mbs:
        for j, i in enumerate(mb.indices.tolist()):
            s = mb.tokens.shape[1]
            assert torch.equal(mb.routes.ids[j], tb.routes.ids[i, :s])
            assert torch.equal(mb.routes.weights[j].nan_to_num(-9), tb.routes.weights[i, :s].nan_to_num(-9))
    covered, fed = tb.routes.coverage(tb.lengths)
    assert (int(covered), int(fed)) == (3 + 6 + 1, 3 + 6 + 1)
    tb.routes.ids[1, 2, 1] = -1  # one MoE layer of one fed position lost its route
    assert int(tb.routes.coverage(tb.lengths)[0]) == 9


def test_batch_without_routes_has_none():
    t = traj(3, 0, 0)
    t.routes = None
    assert TensorBatch.from_trajectories([t]).routes is None
    assert "route_ids" not in pack_batch([t], 1, {}, []).arrays


def test_moe_config_choice():
    MoEConfig(routing_replay="rollout").validate()
    with pytest.raises(ValueError, match=r"moe.routing_replay: must be one of none, rollout; got 'r3'"):
        MoEConfig(routing_replay="r3").validate()


def test_replay_needs_an_moe_model(tmp_path):
    from megarl.config import ConfigError, load_config
    from megarl.models.checks import check_against_model
    from megarl.models.random_hf import tiny_config, write_random_hf
    from megarl.config.server_flags import feature_flags
    from megarl.rollout.setup import routed_experts

    dense = write_random_hf(str(tmp_path / "dense"), tiny_config())
    with pytest.raises(ConfigError, match="moe.routing_replay: rollout needs an MoE model"):
        check_against_model(load_config(None, [f"model.hf_path={dense}", "data.train_path=x",
                                               "moe.routing_replay=rollout"]))
    moe = write_random_hf(str(tmp_path / "moe"), tiny_config("Qwen3MoeForCausalLM"))
    cfg = load_config(None, [f"model.hf_path={moe}", "data.train_path=x", "moe.routing_replay=rollout",
                             "train.algorithm=rl"])
    check_against_model(cfg)  # the local CPU server serves MoE: no refusal
    assert routed_experts(cfg) == (4, 2)
    for engine in ("megarl", "sglang"):  # both engines take the route flag
        assert feature_flags(cfg, engine, gpu=False) == ["--enable-return-routed-experts"]
    off = load_config(None, [f"model.hf_path={moe}", "data.train_path=x"])
    assert feature_flags(off, "sglang", gpu=True) == [] and routed_experts(off) is None
