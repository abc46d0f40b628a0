"""megarl.protocol.refit: shard-to-shard plans against hand-written expectations.

A slice is (trainer rank, server rank, trainer row, server row, rows) in each side's local fused
shard; the expectations below are written out from the layouts in the module docstring."""
import pytest

from megarl.protocol.refit import Slice, gate_up_plan, plain_plan, qkv_plan


def S(*a):
    return Slice(*a)


def test_plain_more_server_shards():
    # 8 rows; trainer halves [0,4) [4,8); server quarters of 2 rows
    assert plain_plan(8, 2, 4) == [S(0, 0, 0, 0, 2), S(0, 1, 2, 0, 2), S(1, 2, 0, 0, 2), S(1, 3, 2, 0, 2)]


def test_plain_fewer_server_shards():
    assert plain_plan(8, 4, 2) == [S(0, 0, 0, 0, 2), S(1, 0, 0, 2, 2), S(2, 1, 0, 0, 2), S(3, 1, 0, 2, 2)]


def test_plain_same_tp_is_one_slice_per_rank():
    assert plain_plan(6, 2, 2) == [S(0, 0, 0, 0, 3), S(1, 1, 0, 0, 3)]


def test_gate_up_one_trainer_two_servers():
    # trainer fc1 = [gate 0..3; up 0..3] (rows 0-7); server j = [gate 2j, 2j+1; up 2j, 2j+1]
    assert gate_up_plan(4, 1, 2) == [S(0, 0, 0, 0, 2), S(0, 0, 4, 2, 2), S(0, 1, 2, 0, 2), S(0, 1, 6, 2, 2)]


def test_gate_up_two_trainers_one_server():
    # trainer i = [gate 2i, 2i+1; up 2i, 2i+1]; server = [gate 0..3; up 0..3]
    assert gate_up_plan(4, 2, 1) == [S(0, 0, 0, 0, 2), S(0, 0, 2, 4, 2), S(1, 0, 0, 2, 2), S(1, 0, 2, 6, 2)]


def test_qkv_one_trainer_two_servers_is_two_contiguous_halves():
    # 4 heads, 2 groups, head_dim 1: trainer rows [q0 q1 k0 v0 | q2 q3 k1 v1]; server 0 holds
    # [q0 q1 k0 v0], server 1 [q2 q3 k1 v1]: each a contiguous block of the trainer's rows
    assert qkv_plan(4, 2, 1, 1, 2) == [S(0, 0, 0, 0, 4), S(0, 1, 4, 0, 4)]


def test_qkv_two_trainers_one_server_deinterleaves():
    # trainer i = [q_{2i} q_{2i+1} k_i v_i]; server = [q0 q1 q2 q3 k0 k1 v0 v1]
    assert qkv_plan(4, 2, 1, 2, 1) == [S(0, 0, 0, 0, 2), S(0, 0, 2, 4, 1), S(0, 0, 3, 6, 1),
                                       S(1, 0, 0, 2, 2), S(1, 0, 2, 5, 1), S(1, 0, 3, 7, 1)]


def test_qkv_replicated_kv_head():
    # 4 heads, 1 group (MQA), server TP 2: trainer [q0 q1 q2 q3 k v]; each server [q_2j q_2j+1 k v]:
    # server 0 takes rows 0-1 and 4-5, server 1 rows 2-5 in one piece (q2 q3 k v are adjacent)
    assert qkv_plan(4, 1, 1, 1, 2) == [S(0, 0, 0, 0, 2), S(0, 0, 4, 2, 2), S(0, 1, 2, 0, 4)]


def test_qkv_head_dim_scales_rows():
    # head_dim 3: the 2x1 case with every row count times 3
    assert qkv_plan(4, 2, 3, 2, 1) == [S(0, 0, 0, 0, 6), S(0, 0, 6, 12, 3), S(0, 0, 9, 18, 3),
                                       S(1, 0, 0, 6, 6), S(1, 0, 6, 15, 3), S(1, 0, 9, 21, 3)]


@pytest.mark.parametrize("t,s", [(1, 1), (1, 2), (2, 1), (2, 2), (2, 4), (4, 2)])
def test_every_server_row_is_written_once(t, s):
    heads, groups, hd = 8, 4, 2
    rows_server = (heads // s + 2 * (groups // s if s <= groups else 1)) * hd
    written = {}
    for sl in qkv_plan(heads, groups, hd, t, s):
        for r in range(sl.rows):
            key = (sl.dst_rank, sl.dst_row + r)
            assert key not in written
            written[key] = (sl.src_rank, sl.src_row + r)
    assert len(written) == s * rows_server


def test_bad_split_names_the_side():
    with pytest.raises(ValueError, match="server query heads"):
        qkv_plan(4, 2, 1, 1, 3)


@pytest.mark.parametrize("t,s", [(1, 2), (2, 1), (2, 2), (2, 4), (4, 2), (1, 8)])
def test_qkv_plan_moves_real_shards(t, s):
    """Executed on tensors: trainer shards cut from Megatron's fused QKV (megarl.models.transforms),
    server shards built SGLang's way; copying every slice makes each server shard exactly."""
    import torch

    from megarl.models import transforms as T

    heads, groups, hd, hidden = 8, 4, 2, 3
    q, k, v = torch.randn(heads * hd, hidden), torch.randn(groups * hd, hidden), torch.randn(groups * hd, hidden)
    fused = T.merge_qkv(q, k, v, heads, groups)
    trainer = [T.shard(fused, 0, t, i) for i in range(t)]
    kv_heads = lambda j: ([j * groups // s + n for n in range(groups // s)] if s <= groups  # noqa: E731
                          else [j * groups // s])
    rows = lambda x, hs: torch.cat([x[h * hd:(h + 1) * hd] for h in hs])  # noqa: E731
    want = [torch.cat([q[j * heads // s * hd:(j + 1) * heads // s * hd], rows(k, kv_heads(j)), rows(v, kv_heads(j))])
            for j in range(s)]
    got = [torch.full_like(w, float("nan")) for w in want]
    for sl in qkv_plan(heads, groups, hd, t, s):
        got[sl.dst_rank][sl.dst_row:sl.dst_row + sl.rows] = trainer[sl.src_rank][sl.src_row:sl.src_row + sl.rows]
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("t,s", [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_gate_up_plan_moves_real_shards(t, s):
    import torch

    from megarl.models import transforms as T

    ffn = 8
    gate, up = torch.randn(ffn, 3), torch.randn(ffn, 3)
    trainer = [T.gate_up_to_shard(gate, up, t, i) for i in range(t)]
    want = [T.gate_up_to_shard(gate, up, s, j) for j in range(s)]  # SGLang's merged column layout is the same
    got = [torch.full_like(w, float("nan")) for w in want]
    for sl in gate_up_plan(ffn, t, s):
        got[sl.dst_rank][sl.dst_row:sl.dst_row + sl.rows] = trainer[sl.src_rank][sl.src_row:sl.src_row + sl.rows]
    for g, w in zip(got, want):
        assert torch.equal(g, w)


# ---- the units the shard push announces (unit_slices) ----------------------------------------
from megarl.protocol.refit import unit_slices  # noqa: E402


def test_vocab_unit_drops_padding_and_reaches_every_server_rank():
    # 10 real rows padded to 12 on 2 trainer ranks (6 each: rank 1 holds rows 6-9 + 2 pad rows);
    # servers replicate the embedding: both server ranks get rows 0-5 from rank 0, 6-9 from rank 1
    assert unit_slices("vocab", 0, 10, 12, 2, 2, 4, 2, 8) == [
        S(0, 0, 0, 0, 6), S(0, 1, 0, 0, 6), S(1, 0, 0, 6, 4), S(1, 1, 0, 6, 4)]


def test_vocab_unit_rank_holding_only_padding_sends_nothing():
    # 5 real rows padded to 8 on 4 ranks of 2: rank 2 holds row 4 + 1 pad row, rank 3 only padding
    assert unit_slices("vocab", 0, 5, 8, 4, 1, 4, 2, 8) == [
        S(0, 0, 0, 0, 2), S(1, 0, 0, 2, 2), S(2, 0, 0, 4, 1)]


def test_replicated_unit_from_trainer_rank_0_to_every_server_rank():
    assert unit_slices("replicated", 0, 64, 0, 2, 3, 4, 2, 8) == [S(0, 0, 0, 0, 64), S(0, 1, 0, 0, 64),
                                                                 S(0, 2, 0, 0, 64)]


def test_split_and_fused_units_follow_the_plans():
    assert unit_slices("split", 1, 8, 0, 2, 4, 4, 2, 8) == plain_plan(8, 2, 4)
    assert unit_slices("gate_up", 0, 4, 0, 1, 2, 4, 2, 8) == gate_up_plan(4, 1, 2)
    assert unit_slices("qkv", 0, 64, 64, 2, 2, 4, 2, 8) == qkv_plan(4, 2, 8, 2, 2)
    with pytest.raises(ValueError, match="unknown refit unit kind 'rows'"):
        unit_slices("rows", 0, 8, 0, 1, 1, 4, 2, 8)
