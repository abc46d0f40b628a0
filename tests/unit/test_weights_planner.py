"""The resharding planner, on metadata only (no distributed init)."""
import pytest
import torch

from megarl.protocol.hf_model import ModelArgs
from megarl.weights.planner import bucketize, plan, stage_of_layer


def args(**kw):
    base = dict(architecture="LlamaForCausalLM", vocab_size=128, hidden_size=64, num_layers=8,
                num_heads=8, num_kv_heads=2, head_dim=8, ffn_hidden_size=96, rms_norm_eps=1e-6,
                rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=False,
                qkv_bias=False, qk_norm=False)
    base.update(kw)
    return ModelArgs(**base)


def by_name(specs):
    return {s.hf_name: s for s in specs}


@pytest.mark.parametrize("heads, kv", [(8, 8), (8, 2), (8, 1)])
def test_gqa_shapes(heads, kv):
    s = by_name(plan(args(num_heads=heads, num_kv_heads=kv)))
    assert s["model.layers.0.self_attn.q_proj.weight"].shape == (heads * 8, 64)
    assert s["model.layers.0.self_attn.k_proj.weight"].shape == (kv * 8, 64)
    assert s["model.layers.0.self_attn.v_proj.weight"].shape == (kv * 8, 64)
    assert s["model.layers.0.self_attn.o_proj.weight"].shape == (64, heads * 8)
    assert s["model.layers.0.self_attn.k_proj.weight"].kind == "qkv"
    assert s["model.layers.0.mlp.up_proj.weight"].shape == (96, 64)


def test_tied_embeddings_send_no_lm_head_and_qwen_extras():
    tied = by_name(plan(args(tie_word_embeddings=True, qkv_bias=True, qk_norm=True), 2))
    assert "lm_head.weight" not in tied and tied["model.embed_tokens.weight"].stage == 0
    assert tied["model.layers.3.self_attn.q_proj.bias"].shape == (64,)
    assert tied["model.layers.3.self_attn.k_norm.weight"].shape == (8,)
    untied = by_name(plan(args(), 2))
    assert untied["lm_head.weight"].stage == 1 and untied["model.norm.weight"].stage == 1
    # 8 layers x 9 tensors (+3 biases +2 q/k norms) + embed + norm (+ head)
    assert len(untied) == 8 * 9 + 3 and len(tied) == 8 * 14 + 2


def test_layer_offsets_across_stages():
    assert [stage_of_layer(i, 8, 2) for i in range(8)] == [(0, None)] * 4 + [(1, None)] * 4
    assert [stage_of_layer(i, 8, 4)[0] for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    # interleaved: 8 layers, pp=2, vpp=2 -> chunks of 2 layers: r0v0, r1v0, r0v1, r1v1
    assert [stage_of_layer(i, 8, 2, 2) for i in range(8)] == [
        (0, 0), (0, 0), (1, 0), (1, 0), (0, 1), (0, 1), (1, 1), (1, 1)]
    specs = plan(args(), 4)
    stages = [s.stage for s in specs]
    assert stages == sorted(stages)  # sources send in stage order
    s = by_name(specs)
    assert s["model.layers.5.input_layernorm.weight"].stage == 2
    assert s["model.layers.5.input_layernorm.weight"].layer == 5


def test_bucketize_caps_bytes_and_never_spans_stages():
    specs = plan(args(), 2)
    cap = 20_000
    buckets = bucketize(specs, cap, torch.float32)
    assert [x for b in buckets for x in b] == specs
    for b in buckets:
        assert len({x.stage for x in b}) == 1
        total = sum(x.nbytes(torch.float32) for x in b)
        assert total <= cap or len(b) == 1  # an oversized tensor travels alone
    emb = by_name(specs)["model.embed_tokens.weight"]
    assert emb.nbytes(torch.float32) == 128 * 64 * 4 and emb.nbytes(torch.bfloat16) == 128 * 64 * 2
    assert len(bucketize(specs, 1 << 30, torch.float32)) == 2  # one per stage


def test_uneven_pipeline_stages_follow_megatrons_first_last_rule():
    from megarl.models.stages import resolve

    # 3 layers over 2 stages: automatic [2, 1]; an explicit first stage of 1 gives [1, 2]
    assert [stage_of_layer(i, 3, 2) for i in range(3)] == [(0, None), (0, None), (1, None)]
    assert [stage_of_layer(i, 3, 2, first=1)[0] for i in range(3)] == [0, 1, 1]
    assert resolve(3, 2).megatron_kwargs() == {"num_layers_in_first_pipeline_stage": 2,
                                               "num_layers_in_last_pipeline_stage": 1}
    assert resolve(8, 2).megatron_kwargs() == {}  # even: Megatron's default split
    assert resolve(10, 4).counts == (2, 3, 3, 2) and resolve(7, 4).counts == (2, 2, 2, 1)
    assert resolve(8, 3, last=2).counts == (3, 3, 2) and resolve(8, 3, first=2).counts == (2, 3, 3)
    s = by_name(plan(args(num_layers=3), resolve(3, 2, first=1)))
    assert s["model.layers.0.mlp.up_proj.weight"].stage == 0
    assert s["model.layers.1.mlp.up_proj.weight"].stage == 1
    assert s["lm_head.weight"].stage == 1 and s["model.embed_tokens.weight"].stage == 0


@pytest.mark.parametrize("layers, pp, first, last, msg", [
    (4, 5, None, None, "parallel.pp: 5 is greater than num_hidden_layers=4"),
    (3, 2, 1, 1, "parallel.first_stage_layers: first + last = 2 must equal num_hidden_layers=3"),
    (8, 4, 3, None, "parallel.first_stage_layers: the remaining 5 layers do not split evenly"),
    (8, 4, None, 3, "parallel.last_stage_layers: the remaining 5 layers do not split evenly"),
    (4, 2, 4, None, "parallel.first_stage_layers: 4 must be in [1, 3]"),
    (4, 1, 2, None, "parallel.first_stage_layers: only with parallel.pp > 1"),
])
def test_bad_pipeline_splits_name_the_field(layers, pp, first, last, msg):
    from megarl.models.stages import resolve

    with pytest.raises(ValueError) as e:
        resolve(layers, pp, None, first, last)
    assert str(e.value).startswith(msg)


def test_vocab_rows_are_the_original_vocab_whatever_the_padding():
    from megarl.models.layouts import pad_vocab

    padded = pad_vocab(args(vocab_size=333), 128, 2)
    assert padded.mcore_vocab_size == 512 and padded.vocab_size == 333
    s = by_name(plan(padded, 2))
    assert s["model.embed_tokens.weight"].shape == (333, 64) and s["lm_head.weight"].shape == (333, 64)
    assert s["model.embed_tokens.weight"].kind == "vocab"
