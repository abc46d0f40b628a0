"""The step hand-off in one form: the manager's flat arrays (ordered by DP rank, whole groups per
rank) -> every rank over a real gloo group (two processes on loopback) -> each DP rank's padded
`TensorBatch`, equal to the old per-trajectory construction; advantages on each rank's share
equal to those of the whole step (group estimators bitwise, step-whitened ones to float64 order)."""
import socket
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megarl.algo import AdvantageConfig, AdvantageEstimator, compute_advantages
from megarl.protocol.packing import pack_batch, share_slices
from megarl.protocol.types import RoutedExperts, Trajectory
from megarl.trainer.batch import TensorBatch
from megarl.trainer.handoff import ReceivedStep

L, K = 2, 2


def make_trajs(n_groups=6, group=3, seed=0, routes=True):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_groups * group):
        n = int(rng.integers(3, 40 if i % 5 else 90))  # a long tail: some groups much longer
        p = int(rng.integers(1, 3))
        r = None
        if routes:
            ids = rng.integers(-1, 8, (n, L, K)).astype(np.int32)
            r = RoutedExperts(ids, rng.random((n, L, K)).astype(np.float32))
        out.append(Trajectory(rng.integers(1, 100, n).tolist(), [0] * p + [1] * (n - p),
                              [0.0] * p + (-rng.random(n - p)).tolist(), [-1] * p + [3] * (n - p),
                              float(rng.integers(0, 3)) / 2, 10 + i // group, {"i": i}, r))
    return out


def assert_same(a: TensorBatch, b: TensorBatch):
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths)
    assert a.fields.keys() == b.fields.keys() and a.sample_fields.keys() == b.sample_fields.keys()
    for k in a.fields:
        assert a.fields[k].dtype == b.fields[k].dtype and torch.equal(a.fields[k], b.fields[k]), k
    for k in a.sample_fields:
        assert a.sample_fields[k].dtype == b.sample_fields[k].dtype
        assert torch.equal(a.sample_fields[k], b.sample_fields[k]), k
    assert torch.equal(a.routes.ids, b.routes.ids)
    assert torch.equal(a.routes.weights.nan_to_num(-9), b.routes.weights.nan_to_num(-9))


def test_shares_are_contiguous_whole_groups_equal_to_the_trajectory_batch():
    trajs = make_trajs()
    batch = pack_batch(trajs, 2, {}, [])
    assert np.all(np.diff(batch.arrays["dp_rank"]) >= 0)  # ordered by DP rank
    step = ReceivedStep(batch.arrays, batch.infos)
    seen = []
    for r in range(2):
        ranked = {i["i"] for i, d in zip(batch.infos, batch.arrays["dp_rank"]) if d == r}
        mine = [t for t in trajs if t.info["i"] in ranked]  # the rank's samples, hand-over order
        rows, _ = share_slices(batch.arrays, r)
        assert [i["i"] for i in batch.infos[rows]] == [t.info["i"] for t in mine]  # hand-over order kept
        assert_same(step.share(r), TensorBatch.from_trajectories(mine))
        seen.append({t.group_id for t in mine})
    assert not seen[0] & seen[1] and seen[0] | seen[1] == {t.group_id for t in trajs}  # groups whole
    tokens = [sum(len(t.input_ids) for t in trajs if t.group_id in s) for s in seen]
    assert max(tokens) - min(tokens) <= max(sum(len(t.input_ids) for t in trajs if t.group_id == g)
                                            for g in seen[0] | seen[1])  # LPT: within one group


def test_from_flat_checks_token_alignment():
    with pytest.raises(ValueError, match=r"batch field 'loss_mask': \(4,\) tokens, expected 5"):
        TensorBatch.from_flat(np.arange(5), np.array([2, 3]), {"loss_mask": np.ones(4)})
    with pytest.raises(ValueError, match=r"dp_rank.*not ordered"):
        share_slices({"dp_rank": np.array([1, 0]), "lengths": np.array([1, 1])}, 0)


def _worker(rank, port, q):
    import torch.distributed as dist

    from megarl.algo.choices import AdvantageConfig, AdvantageEstimator
    from megarl.trainer.actor import Actor
    from megarl.trainer.handoff import receive_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ps = SimpleNamespace(rank=rank, world_size=2, dp=2, dp_rank=rank, dp_group=dist.group.WORLD,
                         device=torch.device("cpu"))
    batch = pack_batch(make_trajs(), 2, {"s": 1}, ["http://x:1"]) if rank == 0 else None
    step = receive_step(batch, ps)
    share = step.share(rank)
    out = {"rejoin": step.rejoin, "n_infos": len(step.infos), "stats": step.stats,
           "arrays": {k: v.copy() for k, v in step.arrays.items()}, "rows": len(share)}
    for est in ("grpo", "reinforce_pp", "gae"):
        spec = SimpleNamespace(advantage=AdvantageConfig(AdvantageEstimator(est), gamma=0.9, lam=0.8),
                               kl_in_reward=False, kl_coef=0.0, distill_coef=0.0)
        values = torch.linspace(-1, 1, share.tokens.numel()).reshape(share.tokens.shape) if est == "gae" else None
        b, _ = Actor(None, ps, engine=None, spec=spec).step_fields(share, version=3, values=values, update=False)
        out[est] = [None if x is None else x.numpy() for x in (b["advantages"], b["returns"], values)]
    q.put((rank, out))  # numpy, not tensors: a tensor's shared memory dies with this process
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned ranks, each importing torch: not in-process
def test_two_ranks_receive_their_share_and_step_advantages():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    ref = pack_batch(make_trajs(), 2, {}, [])
    for r in range(2):
        assert res[r]["rejoin"] == ["http://x:1"]  # every rank re-admits the servers
        for k, v in ref.arrays.items():
            assert np.array_equal(res[r]["arrays"][k], v, equal_nan=True) and res[r]["arrays"][k].dtype == v.dtype, k
    assert res[0]["n_infos"] == 18 and res[1]["n_infos"] == 0  # infos and stats stay on rank 0
    assert res[0]["stats"] == {"s": 1} and res[1]["stats"] == {}
    # DP=1 reference: every sample in one batch (rank 0's rows first, as the arrays are ordered)
    whole = TensorBatch.from_flat(ref.arrays["input_ids"], ref.arrays["lengths"],
                                  {"loss_mask": ref.arrays["loss_mask"]},
                                  {"rewards": ref.arrays["rewards"], "group_ids": ref.arrays["group_ids"]})
    n0 = res[0]["rows"]
    for r in range(2):
        res[r].update({e: [None if x is None else torch.from_numpy(x) for x in res[r][e]]
                       for e in ("grpo", "reinforce_pp", "gae")})
    for est in ("grpo", "reinforce_pp", "gae"):
        values = None
        if est == "gae":  # the two ranks' values, stacked as the whole step's
            s = whole.seq_len
            values = torch.cat([torch.nn.functional.pad(res[r][est][2], (0, s - res[r][est][2].shape[1]))
                                for r in range(2)])
        full = compute_advantages(AdvantageConfig(AdvantageEstimator(est), gamma=0.9, lam=0.8),
                                  whole["rewards"], whole["loss_mask"], whole["group_ids"], values=values)
        for r, rows in ((0, slice(0, n0)), (1, slice(n0, len(whole)))):
            adv, ret, _ = res[r][est]
            want, want_ret = full.advantages[rows, :adv.shape[1]], full.returns[rows, :adv.shape[1]]
            if est == "grpo":  # group statistics only: no collective, the same numbers
                assert torch.equal(adv, want) and torch.equal(ret, want_ret)
            else:  # step-wide whitening from two all-reduced sums
                assert torch.allclose(adv, want, atol=1e-5) and torch.equal(ret, want_ret)
                assert float(adv.abs().max()) > 0.5  # whitened: not all zero
