"""megarl.mcore.context_parallel and megarl.trainer.context without a process group: the chunk
layout (chunk r and 2cp-1-r), the piecewise causal attention of a rank's two chunks against the
whole sequence's keys (forward and every gradient against torch's fused causal attention of the
whole sequence, in float64), packed sequences padded to 2 x cp, and the gather that puts the
per-token outputs of every rank back in position order (emulated by concatenating the ranks'
outputs in rank order, which is what the all-gather returns)."""
import pytest
import torch
import torch.nn.functional as F

from megarl.mcore import context_parallel as cpar
from megarl.mcore.packed import thd_params
from megarl.trainer import context
from megarl.trainer.packing import pack, packed_length, unpack


def test_chunk_positions_balance_the_causal_work():
    assert cpar.chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cpar.chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cpar.chunk_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    assert cpar.padded_length(5, 2) == 8 and cpar.padded_length(8, 2) == 8 and cpar.padded_length(1, 3) == 6
    # causal work of chunk j: j full chunk-pairs + a half; every rank gets (2cp - 1) / 2 + 1
    for cp in (2, 3, 4):
        work = [sum(j + 0.5 for j in (r, 2 * cp - 1 - r)) for r in range(cp)]
        assert len(set(work)) == 1
    every = torch.cat([cpar.chunk_positions(24, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(24))


def _whole_vs_pieces(lengths, cp, heads=4, groups=2, dim=8, batch=1):
    """Reference: fused causal attention per sequence. CP: each rank's local rows against the
    globally ordered K/V through cpar.cp_attention. Returns max |out| and |grad| differences."""
    torch.manual_seed(0)
    total = sum(lengths)
    q = torch.randn(batch, heads, total, dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, groups, total, dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, groups, total, dim, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(batch, heads, total, dim, dtype=torch.float64)
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        outs.append(F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True,
                                                   scale=0.3, enable_gqa=True))
        start += n
    (torch.cat(outs, 2) * grad).sum().backward()
    ref = torch.cat(outs, 2).detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()
    q.grad = k.grad = v.grad = None
    out = torch.zeros_like(ref[0])
    for r in range(cp):
        layout = cpar._layout(lengths, cp, r, "cpu")
        rows = cpar.local_positions(lengths, cp, r)
        o = cpar.cp_attention(q[:, :, rows], k, v, layout, 0.3)
        (o * grad[:, :, rows]).sum().backward()  # gradients of every rank add up, as the gather's backward
        out[:, :, rows] = o.detach()
    return [(a - b).abs().max().item() for a, b in zip(ref, (out, q.grad, k.grad, v.grad))]


@pytest.mark.parametrize("cp", [2, 3])
def test_piecewise_attention_equals_whole_causal_attention(cp):
    assert max(_whole_vs_pieces([8 * cp], cp, batch=2)) < 1e-12


def test_piecewise_attention_per_packed_sequence():
    # three sequences of 4, 12 and 8 (multiples of 2 x cp = 4), keys never cross a boundary
    assert max(_whole_vs_pieces([4, 12, 8], 2)) < 1e-12


def test_pack_pads_each_sequence_to_a_multiple():
    tokens = torch.tensor([[5, 6, 7, 0, 0], [8, 0, 0, 0, 0], [9, 10, 11, 12, 13]])
    lengths = torch.tensor([3, 1, 5])
    assert packed_length(lengths, seq_multiple=4) == 4 + 4 + 8
    pk = pack(tokens, lengths, seq_multiple=4)
    assert pk.tokens.tolist() == [[5, 6, 7, 0, 8, 0, 0, 0, 9, 10, 11, 12, 13, 0, 0, 0]]
    assert pk.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]
    assert pk.params.cu_seqlens_q.tolist() == [0, 4, 8, 16] and pk.real == 9
    assert pk.index.tolist() == [0, 1, 2, 4, 8, 9, 10, 11, 12]
    with pytest.raises(ValueError, match="not a multiple of 4"):
        pack(tokens, lengths, total=18, seq_multiple=4)
    out = torch.arange(1.0, 17.0).unsqueeze(0)
    assert unpack(out, pk).tolist() == [[0.0, 2.0, 3.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0],
                                        [0.0, 10.0, 11.0, 12.0, 13.0]]


def _gathered(locals_, values):
    """What every rank holds after gather_tokens: the ranks' values in rank order, then reordered."""
    return torch.cat(values, dim=1).index_select(1, locals_[0].order)


def test_split_padded_and_gather_give_the_next_token_layout():
    tokens = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 0, 0, 0]])  # s = 5 -> L = 8 at cp = 2
    parts = [context.split_padded(tokens, 2, r) for r in range(2)]
    assert parts[0].tokens.tolist() == [[3, 4, 0, 0], [8, 9, 0, 0]]  # positions 0, 1, 6, 7
    assert parts[1].tokens.tolist() == [[5, 6, 7, 0], [0, 0, 0, 0]]  # positions 2..5
    assert parts[0].position_ids.tolist()[0] == [0, 1, 6, 7]
    assert parts[0].targets.tolist()[0] == [4, 5, 0, 0] and parts[1].targets.tolist()[0] == [6, 7, 0, 0]
    # each rank's "value computed at position p" = 10 p; gathered and shifted: entry p = 10 (p - 1)
    values = [p.position_ids.float() * 10 for p in parts]
    full = _gathered(parts, values)
    shifted = torch.cat([torch.zeros_like(full[:, :1]), full[:, :-1]], dim=1)
    assert shifted[0].tolist() == [0.0, 0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0]


def test_split_packed_rows_follow_each_sequence():
    pk = pack(torch.tensor([[5, 6, 7, 0, 0], [9, 10, 11, 12, 13]]), torch.tensor([3, 5]), seq_multiple=4)
    parts = [context.split_packed(pk, 2, r) for r in range(2)]
    # sequence 0 = rows 0..3 (chunks of 1), sequence 1 = rows 4..11 (chunks of 2)
    assert parts[0].position_ids.tolist() == [[0, 3, 0, 1, 6, 7]]
    assert parts[1].position_ids.tolist() == [[1, 2, 2, 3, 4, 5]]
    assert parts[0].tokens.tolist() == [[5, 0, 9, 10, 0, 0]]
    assert parts[0].targets.tolist() == [[6, 9, 10, 11, 0, 0]]  # the packed row's next token
    rows = [cpar.local_positions([4, 8], 2, r) for r in range(2)]
    full = _gathered(parts, [r.float().unsqueeze(0) for r in rows])
    assert full.tolist() == [[float(i) for i in range(12)]]


def test_thd_layout_is_kept_on_the_params():
    params = thd_params(torch.tensor([0, 4, 12], dtype=torch.int32), 8)
    first = cpar.thd_layout(params, 2, 1)
    assert cpar.thd_layout(params, 2, 1) is first and first.local == 6
