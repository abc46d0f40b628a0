"""megarl.trainer.packing on hand-made rows: the packed row, its positions and sequence
boundaries, the filler that pads a pack to a common length, and the scatter back to [b, s]."""
import torch

from megarl.trainer.packing import pack, packed_length, unpack


def test_pack_lays_sequences_end_to_end_with_positions_restarting():
    tokens = torch.tensor([[5, 6, 7, 0], [8, 0, 0, 0], [9, 10, 11, 12]])
    lengths = torch.tensor([3, 1, 4])
    pk = pack(tokens, lengths)
    assert pk.tokens.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
    assert pk.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert pk.params.qkv_format == "thd" and pk.params.cu_seqlens_q.tolist() == [0, 3, 4, 8]
    assert pk.params.cu_seqlens_q.dtype == torch.int32 and pk.params.max_seqlen_q == 4
    assert pk.real == pk.length == 8 == packed_length(lengths)


def test_filler_pads_a_pack_and_is_dropped():
    tokens = torch.tensor([[5, 6, 0], [7, 8, 9]])
    pk = pack(tokens, torch.tensor([2, 3]), total=packed_length(torch.tensor([2, 3]), multiple=4))
    assert pk.length == 8 and pk.real == 5
    assert pk.tokens.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert pk.position_ids.tolist() == [[0, 1, 0, 1, 2, 0, 1, 2]]  # the filler is a sequence of its own
    assert pk.params.cu_seqlens_q.tolist() == [0, 2, 5, 8]
    # a token-aligned output: entry i came from the outputs before token i
    out = torch.arange(1.0, 9.0).unsqueeze(0).requires_grad_()
    back = unpack(out, pk)
    assert back.tolist() == [[0.0, 2.0, 0.0], [0.0, 4.0, 5.0]]  # 0 at each row's start and past its end
    back.sum().backward()
    assert out.grad.tolist() == [[0, 1, 0, 1, 1, 0, 0, 0]]  # gradient reaches the real, non-first entries only
    assert unpack(None, pk) is None
