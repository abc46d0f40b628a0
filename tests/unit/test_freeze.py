"""optim.freeze: which Megatron rows a list of HF-name patterns freezes, and its config errors."""
import pytest

from megarl.config import load_config
from megarl.common.errors import ConfigError
from megarl.protocol.hf_model import ModelArgs, param_table
from megarl.models.freeze import frozen_rows

ARGS = ModelArgs("LlamaForCausalLM", vocab_size=128, hidden_size=64, num_layers=12, num_heads=4,
                 num_kv_heads=2, head_dim=16, ffn_hidden_size=128, rms_norm_eps=1e-5, rope_theta=1e4,
                 max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False, qk_norm=False)


def test_patterns_pick_rows():
    assert frozen_rows([], ARGS) == frozenset()
    assert frozen_rows(["model.embed_tokens.weight"], ARGS) == {"embedding.word_embeddings.weight"}
    one = frozen_rows(["model.layers.1.*"], ARGS)
    # a Llama layer is 6 Megatron rows (2 norms, fused qkv, o, fused gate/up, down); "1." misses 10, 11
    assert len(one) == 6 and all(n.startswith("decoder.layers.1.") for n in one)
    assert len(frozen_rows(["model.layers.1?.*"], ARGS)) == 12  # layers 10 and 11
    # q, k and v together freeze the fused row
    assert frozen_rows(["model.layers.0.self_attn.[qkv]_proj.weight"], ARGS) == \
        {"decoder.layers.0.self_attention.linear_qkv.weight"}


@pytest.mark.parametrize("patterns, message", [
    (["model.embed.weight"], "optim.freeze: pattern 'model.embed.weight' matches no tensor"),
    (["model.layers.0.self_attn.q_proj.weight"], "optim.freeze: 'model.layers.0.self_attn.q_proj.weight' is fused"),
    (["*"], "optim.freeze: the patterns freeze every parameter"),
])
def test_bad_patterns(patterns, message):
    with pytest.raises(ConfigError) as e:
        frozen_rows(patterns, ARGS)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_config_field():
    cfg = load_config(None, ["data.train_path=x", "model.hf_path=x", 'optim.freeze=["model.embed_tokens.weight"]'])
    assert cfg.optim.freeze == ["model.embed_tokens.weight"]
    with pytest.raises(ConfigError, match=r"^optim.freeze: must be a list"):
        load_config(None, ["data.train_path=x", "model.hf_path=x", 'optim.freeze=[""]'])
    assert len(param_table(ARGS)) == 3 + 6 * 12  # embedding, final norm, lm_head + 6 rows a layer
