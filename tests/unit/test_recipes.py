"""The GPU recipes (configs/qwen2.5-*-gsm8k.yaml) load and validate as they are, against the real
Qwen2.5 config.json dimensions (written into tmp: the weights cannot be downloaded here), and what
they imply is consistent: parameter counts, vocabulary padding, the Megatron layout, batch
arithmetic, the reward plugin, and the GSM8K data preparation. Nothing here runs on a GPU."""
import json
import os

import pytest
import torch

from megarl.config import check_world_size, load_config
from megarl.models import builder, stages
from megarl.models.layouts import hf_shapes, pad_vocab
from megarl.protocol.hf_model import read_model_args
from megarl.rewards import math_reward, load_reward_fn

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_COMMON = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
           "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
           "initializer_range": 0.02, "max_position_embeddings": 32768, "num_hidden_layers": 28,
           "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "torch_dtype": "bfloat16",
           "use_cache": True, "use_sliding_window": False}
# Qwen/Qwen2.5-{1.5B,7B}-Instruct config.json (the fields that differ)
QWEN = {
    "1.5b": dict(_COMMON, hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                 num_key_value_heads=2, max_window_layers=21, sliding_window=32768,
                 tie_word_embeddings=True, vocab_size=151936),
    "7b": dict(_COMMON, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
               num_key_value_heads=4, max_window_layers=28, sliding_window=131072,
               tie_word_embeddings=False, vocab_size=152064),
}
# size: (parameters, tp, world size, Megatron vocabulary rows)
EXPECT = {"1.5b": (1_543_714_304, 1, 4, 151936), "7b": (7_615_616_512, 2, 8, 152064)}


def recipe(size: str, tmp_path):
    model_dir = tmp_path / f"Qwen2.5-{size}"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(QWEN[size]))
    path = os.path.join(REPO, "configs", f"qwen2.5-{size}-gsm8k.yaml")
    return load_config(path, [f"model.hf_path={model_dir}"]), str(model_dir)


@pytest.mark.parametrize("size", ["1.5b", "7b"])
def test_recipe_loads_and_is_a_gpu_recipe(size, tmp_path):
    cfg, model_dir = recipe(size, tmp_path)
    params, tp, world, rows = EXPECT[size]
    assert (cfg.model.spec, cfg.model.dtype, cfg.parallel.backend) == ("te", "bfloat16", "nccl")
    assert cfg.weights.transport == "distributed" and cfg.weights.dtype == "bfloat16"
    assert cfg.train.algorithm == "grpo" and cfg.parallel.distributed_optimizer
    assert len(cfg.rollout.servers) == 4 and all(s.startswith("http://") for s in cfg.rollout.servers)
    assert load_reward_fn(cfg.rollout.reward_fn) is math_reward
    assert (cfg.parallel.tp, cfg.parallel.world_size) == (tp, world)
    dp = check_world_size(cfg, cfg.parallel.world_size)
    assert cfg.train.global_batch_size % (cfg.rollout.group_size * dp) == 0
    assert cfg.train.global_batch_size % cfg.train.ppo_mini_batch_size == 0
    assert cfg.train.micro_batch_tokens >= 2 * cfg.rollout.max_new_tokens  # prompt + response fit
    assert 1e-7 <= cfg.optim.lr <= 1e-5  # full fine-tuning range for RL on 1-10B models

    args = read_model_args(model_dir)
    assert sum(torch.Size(s).numel() for s in hf_shapes(args).values()) == params
    assert args.sliding_window is None  # use_sliding_window=false in both configs
    padded = pad_vocab(args, cfg.model.make_vocab_size_divisible_by, cfg.parallel.tp)
    assert padded.mcore_vocab_size == rows  # no padding rows at these TP sizes
    split = stages.resolve(args.num_layers, cfg.parallel.pp)
    assert split.counts == (28,)
    # Megatron accepts the layout (fp32 + local spec here: bf16 and TE need the GPU)
    tconfig = builder.transformer_config(padded, tp=cfg.parallel.tp, pp=cfg.parallel.pp,
                                         recompute=cfg.model.recompute)
    assert (tconfig.num_attention_heads // tp, tconfig.num_query_groups // tp) in ((12, 2), (14, 2))


def test_recipes_refuse_bf16_and_te_on_this_cpu_machine(tmp_path):
    from megarl.common import compat

    if compat.HAVE_CUDA:
        pytest.skip("checks the CPU refusal")
    cfg, model_dir = recipe("1.5b", tmp_path)
    with pytest.raises(ValueError, match="^model.spec: 'te' needs transformer-engine and a CUDA"):
        builder.resolve_spec(cfg.model.spec)
    with pytest.raises(ValueError, match="^model.dtype: bfloat16 needs a GPU"):
        builder.transformer_config(read_model_args(model_dir), tp=1, pp=1, dtype=cfg.model.dtype)


def test_prepare_gsm8k_and_reward(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("prepare_gsm8k", os.path.join(REPO, "tools", "prepare_gsm8k.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    main = module.main
    src = tmp_path / "src"
    src.mkdir()
    rows = [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
            {"question": "A $1,200 bike is 25% off. Price?", "answer": "1200 * 0.75 = 900\n#### 900"}]
    for split in ("train", "test"):
        (src / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--input", str(src), "--out", str(tmp_path / "out")]) == 0
    got = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert [g["answer"] for g in got] == ["7", "900"]
    assert got[0]["prompt"].startswith("<|im_start|>user\nTom has 3 apples")
    assert got[0]["prompt"].endswith("<|im_start|>assistant\n")
    meta = {"answer": got[1]["answer"]}
    assert math_reward("", "25% of 1,200 is 300, so 1,200 - 300 = 900.\n#### 900<|im_end|>", meta) == 1.0
    assert math_reward("", "The price is \\boxed{900.00}", meta) == 1.0
    assert math_reward("", "#### 899", meta) == 0.0 and math_reward("", "no idea", meta) == 0.0


# Qwen/Qwen3-30B-A3B config.json (the fields megarl and transformers read)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}


def test_moe_recipe_loads_with_expert_parallelism(tmp_path):
    """configs/qwen3-30b-a3b-gsm8k.yaml: 30.5B parameters, EP=8 over DP=16 (16 experts of each
    layer per rank, 2 replicas), grouped-GEMM experts on the TE spec, top-8 renormalised routing;
    asynchronous against SGLang servers with routing replay (the tiny twin of that combination
    passes the mismatch gate every step: tests/e2e/test_sglang_moe.py), and megarl-launch starts
    its SGLang servers with the routes flag."""
    from megarl.config.moe import MoEConfig
    from megarl.config.server_flags import feature_flags

    model_dir = tmp_path / "Qwen3-30B-A3B"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    cfg = load_config(os.path.join(REPO, "configs", "qwen3-30b-a3b-gsm8k.yaml"), [f"model.hf_path={model_dir}"])
    assert (cfg.model.spec, cfg.model.dtype, cfg.parallel.backend) == ("te", "bfloat16", "nccl")
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.world_size) == (1, 1, 8, 16)
    assert cfg.moe == MoEConfig(routing_replay="rollout", aux_loss_coeff=0.0)  # R3
    assert cfg.rollout.max_staleness == 1 and cfg.rollout.partial_rollout  # asynchronous
    assert feature_flags(cfg, "sglang", gpu=True) == ["--enable-return-routed-experts"]
    dp = check_world_size(cfg, cfg.parallel.world_size)
    assert dp == 16 and cfg.train.global_batch_size % (cfg.rollout.group_size * dp) == 0
    assert len(cfg.rollout.servers) == 2 and load_reward_fn(cfg.rollout.reward_fn) is math_reward
    args = read_model_args(str(model_dir))
    assert (args.num_experts, args.moe_topk, args.moe_ffn_hidden_size, args.moe_norm_topk) == (128, 8, 768, True)
    assert args.sliding_window is None
    assert sum(torch.Size(s).numel() for s in hf_shapes(args).values()) == 30_532_122_624
    padded = pad_vocab(args, cfg.model.make_vocab_size_divisible_by, cfg.parallel.tp)
    assert padded.mcore_vocab_size == 151936
    tconfig = builder.transformer_config(padded, tp=1, pp=1, ep=cfg.parallel.ep, use_te=True,
                                         recompute=cfg.model.recompute, moe=cfg.moe)
    assert (tconfig.num_moe_experts // tconfig.expert_model_parallel_size, tconfig.moe_router_topk) == (16, 8)
    assert tconfig.moe_grouped_gemm and not tconfig.moe_router_pre_softmax
    assert tconfig.moe_router_load_balancing_type == "none"


# deepseek-ai/DeepSeek-R1-Distill-Qwen-7B config.json (the fields megarl and transformers read)
R1_DISTILL_7B = dict(_COMMON, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                     num_key_value_heads=4, max_window_layers=28, sliding_window=4096,
                     max_position_embeddings=131072, rope_theta=10000.0, tie_word_embeddings=False,
                     vocab_size=152064, bos_token_id=151646, eos_token_id=151643)


def test_long_reasoning_recipe_splits_each_sequence_over_cp(tmp_path):
    """configs/qwen2.5-7b-long-reasoning.yaml: 16k-token answers, TP=2 x CP=2 x DP=2 on 8 GPUs, a
    17k-token sequence per micro-batch split over the CP pair (8.7k tokens per rank), packed,
    background checkpoints; Megatron builds the layout with context_parallel_size 2."""
    model_dir = tmp_path / "R1-Distill-Qwen-7B"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(R1_DISTILL_7B))
    cfg = load_config(os.path.join(REPO, "configs", "qwen2.5-7b-long-reasoning.yaml"), [f"model.hf_path={model_dir}"])
    p = cfg.parallel
    assert (p.tp, p.cp, p.pp, p.world_size, p.cp_comm_type) == (2, 2, 1, 8, "p2p")
    assert check_world_size(cfg, p.world_size) == 2 and p.model_parallel == 4
    assert (cfg.model.spec, cfg.model.dtype) == ("te", "bfloat16")
    assert cfg.rollout.max_new_tokens == 16384 and cfg.rollout.partial_rollout
    assert cfg.train.pack_sequences and cfg.checkpoint.async_save
    # one whole sequence (a prompt of up to 1k tokens + the longest answer) per micro-batch
    assert cfg.train.micro_batch_tokens * p.cp >= 1024 + cfg.rollout.max_new_tokens
    assert cfg.train.max_seq_len >= 1024 + cfg.rollout.max_new_tokens
    assert cfg.train.global_batch_size % (cfg.rollout.group_size * 2) == 0
    args = read_model_args(str(model_dir))
    assert args.sliding_window is None and args.max_position_embeddings >= cfg.train.max_seq_len
    padded = pad_vocab(args, cfg.model.make_vocab_size_divisible_by, p.tp)
    tconfig = builder.transformer_config(padded, tp=p.tp, pp=p.pp, cp=p.cp, cp_comm_type=p.cp_comm_type,
                                         recompute=cfg.model.recompute)
    assert (tconfig.context_parallel_size, tconfig.cp_comm_type) == (2, "p2p")
