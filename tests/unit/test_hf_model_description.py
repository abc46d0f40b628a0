"""One HF model description for every program: for each architecture of the one table
(`megarl.protocol.architectures`), a tiny config.json is read by megarl-server (its forward's
`DecoderConfig`) and by the trainer (the `ModelArgs` its model builder turns into Megatron's
`TransformerConfig`), and both get the same sizes, heads, biases, norms, RoPE, windows per layer
and MoE shape; the repository's tiny models (examples/tiny, examples/tiny_moe) likewise. What a
program cannot run (an architecture or a feature) fails with one line naming the file, the
architecture or field and the program; an architecture outside the table names itself and the file.
Real components: the protocol reader, the server's config, megatron-core's TransformerConfig."""
from __future__ import annotations

import json
import os

import pytest

from megarl.models import builder
from megarl.models.random_hf import tiny_config
from megarl.protocol.architectures import ARCHITECTURES, SERVER, TRAINER
from megarl.protocol.hf_model import read_model_args
from megarl.server.model import DecoderConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
HEADS = dict(num_attention_heads=4, num_key_value_heads=2)  # random_hf.TINY has the trainer's rows only
# one tiny config.json per row of the table, each switching on what its architecture has
CONFIGS = {
    "LlamaForCausalLM": tiny_config("LlamaForCausalLM", rope_scaling=LLAMA3, rope_theta=500000.0),
    "MistralForCausalLM": tiny_config("MistralForCausalLM", sliding_window=8, rms_norm_eps=1e-5),
    "Qwen2ForCausalLM": tiny_config("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=6,
                                    max_window_layers=2),
    "Qwen3ForCausalLM": tiny_config("Qwen3ForCausalLM", use_sliding_window=True, sliding_window=5, layer_types=[
        "sliding_attention", "full_attention", "full_attention", "sliding_attention"]),
    "Qwen3MoeForCausalLM": tiny_config("Qwen3MoeForCausalLM", use_sliding_window=True, sliding_window=7),
    "Qwen2MoeForCausalLM": tiny_config("Qwen2MoeForCausalLM", **HEADS, num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=48, norm_topk_prob=False),
    "LlamaForSequenceClassification": tiny_config("LlamaForSequenceClassification", **HEADS, num_labels=1,
                                                  pad_token_id=0, tie_word_embeddings=True),
    "Qwen2ForSequenceClassification": tiny_config("Qwen2ForSequenceClassification", **HEADS,
                                                  id2label={"0": "a", "1": "b", "2": "c"}),
}


def _write(tmp_path, name: str, cfg: dict) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _megatron_view(args) -> dict:
    """What the trainer's model builder hands Megatron, in the server config's terms."""
    tc = builder.transformer_config(args, tp=1, pp=1)
    if tc.window_size is None:
        windows = (None,) * tc.num_layers
    else:
        on = tc.window_attn_skip_freq if isinstance(tc.window_attn_skip_freq, list) else [1] * tc.num_layers
        windows = tuple(tc.window_size[0] + 1 if w else None for w in on)
    moe = None
    if tc.num_moe_experts:
        moe = (tc.num_moe_experts, tc.moe_router_topk, tc.moe_ffn_hidden_size, not tc.moe_router_pre_softmax)
    return dict(vocab_size=args.vocab_size, hidden_size=tc.hidden_size, intermediate_size=tc.ffn_hidden_size,
                num_layers=tc.num_layers, num_heads=tc.num_attention_heads, num_kv_heads=tc.num_query_groups,
                head_dim=tc.kv_channels, rms_norm_eps=tc.layernorm_epsilon, qkv_bias=tc.add_qkv_bias,
                o_bias=tc.add_bias_linear, mlp_bias=tc.add_bias_linear, qk_norm=tc.qk_layernorm,
                rope_theta=args.rope_theta, rope_factor=args.rope_scaling_factor,
                tie_word_embeddings=args.tie_word_embeddings,
                max_position_embeddings=args.max_position_embeddings, layer_windows=windows, moe=moe)


def _server_view(cfg: DecoderConfig) -> dict:
    moe = cfg.moe and (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.expert_intermediate, cfg.moe.norm_topk_prob)
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_layers=cfg.num_layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias,
                mlp_bias=cfg.mlp_bias, qk_norm=cfg.qk_norm, rope_theta=cfg.rope_theta,
                rope_factor=(cfg.rope_scaling or {}).get("factor"), tie_word_embeddings=cfg.tie_word_embeddings,
                max_position_embeddings=cfg.max_position_embeddings, layer_windows=cfg.layer_windows, moe=moe)


def test_every_architecture_of_the_table_has_a_config_here():
    assert set(CONFIGS) == set(ARCHITECTURES)


# what each synthesized config must give (server view), so a reader that drops a field fails
EXPECTED = {
    "LlamaForCausalLM": dict(rope_theta=500000.0, rope_factor=8.0, layer_windows=(None,) * 4, head_dim=16),
    "MistralForCausalLM": dict(layer_windows=(8, 8, 8, 8), rms_norm_eps=1e-5, qkv_bias=False),
    "Qwen2ForCausalLM": dict(layer_windows=(None, None, 6, 6), qkv_bias=True, tie_word_embeddings=True),
    "Qwen3ForCausalLM": dict(layer_windows=(5, None, None, 5), qk_norm=True, head_dim=32),
    "Qwen3MoeForCausalLM": dict(layer_windows=(7, 7, 7, 7), moe=(4, 2, 32, True), qk_norm=True),
}


@pytest.mark.parametrize("name", [n for n in CONFIGS if TRAINER in ARCHITECTURES[n].programs])
def test_server_and_trainer_read_the_same_values(tmp_path, name):
    path = _write(tmp_path, name, CONFIGS[name])
    server = _server_view(DecoderConfig.from_dir(path))
    trainer = _megatron_view(read_model_args(path))
    assert server == trainer
    assert {k: server[k] for k in EXPECTED[name]} == EXPECTED[name]
    assert (server["num_layers"], server["num_heads"], server["num_kv_heads"], server["vocab_size"]) == (4, 4, 2, 128)


def test_server_only_rows_are_served_and_refused_by_the_trainer_naming_both(tmp_path):
    served = {}
    for name in [n for n in CONFIGS if TRAINER not in ARCHITECTURES[n].programs]:
        path = _write(tmp_path, name, CONFIGS[name])
        cfg = DecoderConfig.from_dir(path)
        served[name] = (cfg.num_labels, cfg.tie_word_embeddings, cfg.pad_token_id,
                        cfg.moe and (cfg.moe.num_experts, cfg.moe.shared_intermediate, cfg.moe.norm_topk_prob))
        with pytest.raises(ValueError) as e:
            read_model_args(path)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(os.path.join(path, "config.json") + ": ")
        assert f"architectures[0]={name!r} is not supported by {TRAINER} (only by {SERVER})" in msg
    assert served == {"Qwen2MoeForCausalLM": (0, False, None, (4, 48, False)),
                      "LlamaForSequenceClassification": (1, False, 0, None),
                      "Qwen2ForSequenceClassification": (3, False, None, None)}


@pytest.mark.parametrize("model", ["tiny/model", "tiny/hf", "tiny_moe/model", "tiny_moe/hf"])
def test_the_repositorys_tiny_models_read_alike(model):
    path = os.path.join(REPO, "examples", model)
    server = _server_view(DecoderConfig.from_dir(path))
    assert server == _megatron_view(read_model_args(path))
    assert (server["moe"] is not None) == model.startswith("tiny_moe")


def test_unknown_architecture_names_itself_and_the_file(tmp_path):
    path = _write(tmp_path, "gpt2", tiny_config("GPT2LMHeadModel"))
    config = os.path.join(path, "config.json")
    for read in (read_model_args, DecoderConfig.from_dir):
        with pytest.raises(ValueError) as e:
            read(path)
        msg = str(e.value)
        assert "\n" not in msg
        assert msg.startswith(f"{config}: unsupported architecture: architectures[0]='GPT2LMHeadModel' is not "
                              "supported; supported: LlamaForCausalLM, ")
    # the trainer's list is its rows of the table, then what only the server runs
    assert msg.endswith("Qwen3MoeForCausalLM")  # the server's (last read) runs every row
    with pytest.raises(ValueError, match=r"Qwen3MoeForCausalLM \(megarl-server also runs "
                                         r"LlamaForSequenceClassification, Qwen2ForSequenceClassification, "
                                         r"Qwen2MoeForCausalLM\)$"):
        read_model_args(path)


@pytest.mark.parametrize("name,extra,needle", [
    ("LlamaForCausalLM", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
     "rope_scaling type 'linear' is not supported by the trainer (only llama3)"),
    ("LlamaForCausalLM", dict(rope_scaling=dict(LLAMA3, high_freq_factor=2.0)),
     "rope_scaling.high_freq_factor=2.0 is not supported by the trainer (Megatron's llama3 RoPE fixes it to 4)"),
    ("LlamaForCausalLM", dict(attention_bias=True), "attention_bias=true (an o_proj bias) is not supported by "
                                                    "the trainer"),
    ("LlamaForCausalLM", dict(mlp_bias=True), "mlp_bias=true is not supported by the trainer"),
    ("Qwen3MoeForCausalLM", dict(mlp_only_layers=[1]), "mlp_only_layers / decoder_sparse_step > 1 (dense layers "
                                                       "in an MoE model) are not supported by the trainer"),
])
def test_features_only_the_server_computes_are_refused_by_the_trainer(tmp_path, name, extra, needle):
    path = _write(tmp_path, "m", tiny_config(name, **extra))
    cfg = DecoderConfig.from_dir(path)  # the server runs it
    assert (cfg.rope_scaling, cfg.o_bias, cfg.mlp_bias) == (extra.get("rope_scaling"), "attention_bias" in extra,
                                                           "mlp_bias" in extra)
    assert cfg.moe is None or cfg.moe.moe_layers == (True, "mlp_only_layers" not in extra, True, True)
    with pytest.raises(ValueError) as e:
        read_model_args(path)
    assert str(e.value) == f"{os.path.join(path, 'config.json')}: {needle}"


def test_preflight_names_the_field_the_architecture_and_the_program(tmp_path):
    from megarl.common.errors import ConfigError
    from megarl.launch.preflight import _model_args

    path = _write(tmp_path, "m", CONFIGS["Qwen2MoeForCausalLM"])
    with pytest.raises(ConfigError) as e:
        _model_args("model.hf_path", path)
    assert str(e.value).startswith(f"model.hf_path: {path}/config.json: architectures[0]='Qwen2MoeForCausalLM' "
                                   "is not supported by the trainer (only by megarl-server)")
