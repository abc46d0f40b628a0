"""Server tensor parallelism's pure parts (megarl.server.tp): which slice of each HF tensor a TP
rank holds, that the slices reassemble into the tensor, and the layouts --tp refuses."""
import pytest
import torch

from megarl.models.random_hf import tiny_config
from megarl.server.model import DecoderConfig
from megarl.server.tp import assemble, full_shape, local_slice, shard_config, shard_spec


def cfg(**kw):
    return DecoderConfig.from_hf(tiny_config("Qwen3ForCausalLM", **kw))  # 4 heads of 32, ffn 128


def test_slices_by_hand():
    c = cfg(num_key_value_heads=2)
    # q: 4 heads x 32 rows -> 64 rows per rank; k/v: one kv head (32 rows) each; o/down by columns
    assert shard_spec("model.layers.0.self_attn.q_proj.weight", c, 1, 2) == (0, 64, 64, 128)
    assert shard_spec("model.layers.0.self_attn.k_proj.weight", c, 1, 2) == (0, 32, 32, 64)
    assert shard_spec("model.layers.3.mlp.up_proj.weight", c, 1, 2) == (0, 64, 64, 128)
    assert shard_spec("model.layers.0.self_attn.o_proj.weight", c, 1, 2) == (1, 64, 64, 128)
    assert shard_spec("model.layers.0.mlp.down_proj.weight", c, 0, 2) == (1, 0, 64, 128)
    for replicated in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                       "model.layers.0.self_attn.q_norm.weight", "model.layers.0.input_layernorm.weight"):
        assert shard_spec(replicated, c, 1, 2) is None
    assert shard_spec("model.layers.0.self_attn.q_proj.weight", c, 0, 1) is None


def test_replicated_kv_heads():
    c = cfg(num_key_value_heads=1)  # TP=2 > 1 kv head: both ranks hold kv head 0
    for r in (0, 1):
        assert shard_spec("model.layers.0.self_attn.v_proj.weight", c, r, 2) == (0, 0, 32, 32)
    c = cfg(num_attention_heads=8, num_key_value_heads=2)  # TP=4: ranks 0,1 -> kv 0; 2,3 -> kv 1
    assert [shard_spec("m.layers.0.self_attn.k_proj.weight", c, r, 4)[1] for r in range(4)] == [0, 0, 32, 32]
    assert shard_config(c, 4).num_kv_heads == 1 and shard_config(c, 4).num_heads == 2


@pytest.mark.parametrize("kv,tp", [(2, 2), (1, 2), (2, 4), (4, 4), (4, 2)])
def test_slices_reassemble(kv, tp):
    c = cfg(num_attention_heads=8, num_key_value_heads=kv, intermediate_size=256)
    shapes = {"model.layers.0.self_attn.q_proj.weight": (256, 64), "model.layers.0.self_attn.k_proj.weight":
              (kv * 32, 64), "model.layers.0.self_attn.v_proj.bias": (kv * 32,),
              "model.layers.0.self_attn.o_proj.weight": (64, 256), "model.layers.0.mlp.gate_proj.weight":
              (256, 64), "model.layers.0.mlp.down_proj.weight": (64, 256), "model.norm.weight": (64,)}
    for name, shape in shapes.items():
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        parts = [local_slice(name, full, c, r, tp) for r in range(tp)]
        assert torch.equal(assemble(name, parts, c, tp), full)
        assert full_shape(name, parts[0].shape, c, tp) == shape


def test_refusals_name_the_flag():
    with pytest.raises(ValueError, match=r"--tp 2: Qwen3MoeForCausalLM is a mixture-of-experts"):
        shard_config(DecoderConfig.from_hf(tiny_config("Qwen3MoeForCausalLM")), 2)
    with pytest.raises(ValueError, match=r"--tp 3: must divide num_attention_heads=4"):
        shard_config(cfg(), 3)
    with pytest.raises(ValueError, match=r"num_key_value_heads=3"):
        shard_config(cfg(num_attention_heads=6, num_key_value_heads=3, head_dim=16), 2)


def test_shard_refit_config_refusals(tmp_path):
    from megarl.config import ConfigError, load_config
    from megarl.models.random_hf import write_random_hf

    hf = write_random_hf(str(tmp_path / "m"), tiny_config(), seed=0)
    base = [f"model.hf_path={hf}", "data.train_path=x", "weights.refit=shard"]
    with pytest.raises(ConfigError, match=r"weights.refit: shard needs weights.transport=distributed"):
        load_config(None, base + ["weights.transport=disk"])
    with pytest.raises(ConfigError, match=r"weights.refit: shard supports dense models on one pipeline stage"):
        load_config(None, base + ["parallel.pp=2"])
    with pytest.raises(ConfigError, match=r"weights.refit"):
        load_config(None, [f"model.hf_path={hf}", "data.train_path=x", "weights.refit=scatter"])
    assert load_config(None, base).weights.refit == "shard"
