"""What a run's features need of its inference servers, decided once
(`megarl.config.server_flags.feature_flags`) and used by every place that starts one: the rollout
manager's local servers (`ManagerSpec.server_flags`), `megarl-launch`'s planned servers (what
`--dry-run` prints) and the colocated placement."""
import json
import os

import pytest

from megarl.config import load_config
from megarl.config.server_flags import feature_flags
from megarl.launch.plan import Allocation, make_plan, render

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "configs", "tiny_grpo.yaml")
ROUTES = ["--enable-return-routed-experts"]
LORA8 = ["--enable-lora", "--max-lora-rank", "8", "--max-loras-per-batch", "2", "--lora-target-modules",
         "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
SAVER = ["--enable-memory-saver"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """config.json of a Qwen3-MoE-shaped model (routing replay needs experts)."""
    d = tmp_path_factory.mktemp("moe")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "num_attention_heads": 8, "num_key_value_heads": 4,
        "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 1024, "head_dim": 32,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1e6}))
    return str(d)


COLOCATED = ["rollout.placement=colocated", "rollout.max_staleness=0"]
CASES = [  # (overrides, engine, gpu, flags)
    ([], "sglang", True, []),
    ([], "megarl", False, []),
    (["moe.routing_replay=rollout"], "megarl", False, ROUTES),
    (["moe.routing_replay=rollout"], "sglang", True, ROUTES),
    (["lora.rank=8", "lora.alpha=16"], "sglang", False, LORA8),
    (["lora.rank=8", "lora.alpha=16"], "megarl", True, []),  # megarl-server merges pushed adapters
    (COLOCATED, "sglang", True, SAVER),
    (COLOCATED, "sglang", False, []),  # torch_memory_saver is CUDA-only
    (COLOCATED, "megarl", True, []),  # megarl-server sleeps without a flag
    (["moe.routing_replay=rollout", *COLOCATED], "sglang", True, ROUTES + SAVER),
    (["moe.routing_replay=rollout", "lora.rank=8", "lora.alpha=16"], "sglang", True, ROUTES + LORA8),
]


@pytest.mark.parametrize("overrides,engine,gpu,flags", CASES)
def test_each_feature_asks_its_engine_flags(overrides, engine, gpu, flags, moe):
    cfg = load_config(DEMO, [f"model.hf_path={moe}", *overrides])
    assert feature_flags(cfg, engine, gpu) == flags


def test_the_local_servers_get_them(moe):
    from megarl.rollout.manager import ManagerSpec
    from megarl.rollout.probe import check_wire

    cfg = load_config(DEMO, [f"model.hf_path={moe}", "moe.routing_replay=rollout", "lora.rank=8"])
    check_wire(cfg)
    assert ManagerSpec.from_config(cfg).server_flags == tuple(ROUTES)  # megarl-server on this CPU machine


def _servers(overrides, **alloc):
    cfg = load_config(DEMO, overrides)
    return [line for line in render(make_plan(cfg, "configs/tiny_grpo.yaml", overrides, Allocation(**alloc)))
            if line.startswith("server ")]


def test_megarl_launch_plans_them_before_the_users_own(moe):
    """`--dry-run` shows each engine flag the recipe's features need, on every planned server;
    launch.server_args come last (a repeated option takes its last value)."""
    ov = [f"model.hf_path={moe}", "moe.routing_replay=rollout", "lora.rank=8", "lora.alpha=16",
          "launch.server=sglang", "launch.server_args=[--log-level,info]"]
    servers = _servers(ov, trainer_nodes=("t",), rollout_nodes=("r1", "r2"), gpus_per_node=2)
    assert len(servers) == 4
    for line in servers:
        assert line.endswith(" ".join(ROUTES + LORA8 + ["--log-level", "info"]))
    cpu = _servers([f"model.hf_path={moe}", "moe.routing_replay=rollout", "lora.rank=8"],
                   trainer_nodes=("t",), rollout_nodes=("r",))
    assert len(cpu) == 1 and "python -m megarl.server" in cpu[0]
    assert " --enable-return-routed-experts" in cpu[0] and "--enable-lora" not in cpu[0]
    plain = _servers([f"model.hf_path={moe}", "launch.server=sglang"], trainer_nodes=("t",), rollout_nodes=("r",),
                     gpus_per_node=2)
    assert "--enable-" not in plain[0]
