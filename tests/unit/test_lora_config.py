"""The lora section: validation with one-line errors naming the field, the rules across sections,
the layer classes LoRA wraps (local and TE spec) and the pure HF/PEFT adapter names and sizes."""
import pytest
import torch

from megarl.config import ConfigError, load_config
from megarl.mcore import lora as L
from megarl.models import lora as HF
from megarl.models.random_hf import tiny_config
from megarl.protocol.hf_model import ModelArgs

BASE = ["model.hf_path=x", "data.train_path=x"]
RL = BASE + ["train.algorithm=rl"]


def load(*overrides, base=BASE):
    return load_config(None, [*base, *overrides])


def test_defaults_off_and_scaling():
    cfg = load()
    assert not cfg.lora.enabled
    cfg = load("lora.rank=8", "lora.alpha=32")
    assert cfg.lora.enabled and cfg.lora.scaling == 4.0
    assert cfg.lora.target_modules == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


@pytest.mark.parametrize("overrides,field", [
    (["lora.rank=-1"], "lora.rank"),
    (["lora.rank=4", "lora.alpha=0"], "lora.alpha"),
    (["lora.rank=4", "lora.dropout=1.0"], "lora.dropout"),
    (["lora.rank=4", "lora.target_modules=[q_proj]"], "lora.target_modules"),
    (["lora.rank=4", "lora.target_modules=[]"], "lora.target_modules"),
    (["lora.rank=4", "lora.target_modules=[linear_qkv,linear_qkv]"], "lora.target_modules"),
    (["lora.rank=4", "optim.freeze=[model.embed_tokens.weight]"], "optim.freeze"),
    (["lora.rank=4", "parallel.sequence_parallel=true"], "parallel.sequence_parallel"),
])
def test_bad_values_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        load(*overrides)
    msg = str(e.value)
    assert msg.startswith(field + ":") and "\n" not in msg


@pytest.mark.parametrize("overrides,field", [
    (["weights.refit=shard"], "weights.refit"),
    (["rollout.placement=colocated", "rollout.servers=[]"], "rollout.placement"),
    (["algo.advantage=gae"], "algo.advantage"),
    (["weights.transport=disk"], "weights.transport"),
    (["rollout.engine=sglang", "weights.pause_mode=retract"], "weights.pause_mode"),
    (["weights.tensor_format=sglang", "weights.pause_mode=in_place"], "weights.pause_mode"),
])
def test_rl_rules(overrides, field):
    with pytest.raises(ConfigError) as e:
        load("lora.rank=4", *overrides, base=RL)
    assert str(e.value).startswith(field + ":")


def test_layer_kind_covers_local_and_te_classes():
    # TransformerEngine cannot run on this CPU machine: stand-in classes carry TE's class names,
    # which is all the selection reads (the wrapper then calls the real class's forward)
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    te = {name: type(name, (torch.nn.Module,), {}) for name in
          ("TELayerNormColumnParallelLinear", "TEColumnParallelLinear", "TERowParallelLinear")}
    assert L.layer_kind(te["TELayerNormColumnParallelLinear"]()) == "column"
    assert L.layer_kind(te["TEColumnParallelLinear"]()) == "column"
    assert L.layer_kind(te["TERowParallelLinear"]()) == "row"
    assert L.layer_kind(ColumnParallelLinear.__new__(ColumnParallelLinear)) == "column"
    assert L.layer_kind(RowParallelLinear.__new__(RowParallelLinear)) == "row"
    with pytest.raises(ConfigError, match="lora.target_modules"):
        L.layer_kind(torch.nn.Linear(2, 2))


def _args() -> ModelArgs:
    import json
    import tempfile
    from megarl.protocol.hf_model import read_model_args

    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/config.json", "w") as f:
            json.dump(tiny_config("LlamaForCausalLM"), f)
        return read_model_args(d)


def test_peft_names_and_bytes():
    args = _args()  # 4 layers, hidden 64, 4 heads x 16, 2 kv heads, ffn 128
    shapes = HF.hf_adapter_shapes(args, ["linear_qkv", "linear_fc2"], rank=8)
    assert shapes["model.layers.0.self_attn.q_proj.lora_A.weight"] == (8, 64)
    assert shapes["model.layers.0.self_attn.q_proj.lora_B.weight"] == (64, 8)
    assert shapes["model.layers.3.self_attn.v_proj.lora_B.weight"] == (32, 8)
    assert shapes["model.layers.1.mlp.down_proj.lora_A.weight"] == (8, 128)
    assert shapes["model.layers.1.mlp.down_proj.lora_B.weight"] == (64, 8)
    assert not any("o_proj" in n or "gate_proj" in n for n in shapes)
    per_layer = (3 * 8 * 64 + 8 * (64 + 32 + 32)) + (8 * 128 + 64 * 8)  # qkv: 3 A + 3 B; down
    assert HF.adapter_bytes(args, ["linear_qkv", "linear_fc2"], 8, range(4), torch.float32) == 4 * per_layer * 4 + 4
    assert HF.adapter_bytes(args, ["linear_qkv", "linear_fc2"], 8, [0], torch.bfloat16) == per_layer * 2 + 4


def test_merge_hf():
    w = torch.randn(6, 5)
    a, b = torch.randn(2, 5), torch.randn(6, 2)
    out = HF.merge_hf({"m.weight": w}, {"m.lora_A.weight": a, "m.lora_B.weight": b}, 0.5)
    assert torch.allclose(out["m.weight"], w + 0.5 * b @ a)


def test_sglang_servers_get_lora_flags_and_requests_name_the_adapter(tmp_path):
    """LoRA on SGLang (rollout.engine=sglang): the local servers start with SGLang's adapter
    support sized for the run, and the rollout client names the adapter the trainer's push loaded
    for the servers' current version in every /generate (megarl-server merges pushed adapters
    instead: no flags, no lora_path)."""
    from megarl.config.server_wire import local_extensions, resolve_wire
    from megarl.rollout.client import RolloutClient
    from megarl.config.server_flags import feature_flags
    from megarl.protocol.wire_plan import WirePlan
    from megarl.rollout.manager import ManagerSpec
    from megarl.rollout.sglang_local import server_args

    cfg = load("lora.rank=4", "lora.target_modules=[linear_qkv,linear_fc2]", "rollout.engine=sglang",
               f"train.run_dir={tmp_path}/run", base=RL)
    cfg.weights = resolve_wire(cfg.weights, {"local": local_extensions("sglang")}, lora=cfg.lora.enabled)
    assert (cfg.weights.tensor_format, cfg.weights.pause_mode) == ("sglang", "abort")
    wire = WirePlan.of_config(cfg)
    assert wire.peft and ManagerSpec.from_config(cfg).controller.lora_adapters
    flags = feature_flags(cfg, "sglang", gpu=False)
    assert flags == ["--enable-lora", "--max-lora-rank", "4", "--max-loras-per-batch", "2",
                     "--lora-target-modules", "down_proj", "k_proj", "q_proj", "v_proj"]
    args = server_args("m", 1, extra=flags)
    assert args[args.index("--lora-backend") + 1] == "torch_native"  # CPU: the default backend is Triton's
    assert "--lora-backend" not in server_args("m", 1, extra=flags, cpu=False)
    version = [3]
    client = RolloutClient(["http://127.0.0.1:9"], version_fn=lambda: version[0], lora_adapters=True)
    assert client._options() == {"lora_path": "megarl-policy-v3"}
    version[0] = 4
    assert client._options() == {"lora_path": "megarl-policy-v4"}
    assert RolloutClient(["http://127.0.0.1:9"])._options() == {}

    megarl = load("lora.rank=4", f"train.run_dir={tmp_path}/run", base=RL)
    megarl.weights = resolve_wire(megarl.weights, {"local": local_extensions("megarl")}, lora=True)
    assert WirePlan.of_config(megarl).adapters == "merged" and feature_flags(megarl, "megarl", gpu=True) == []
    assert not ManagerSpec.from_config(megarl).controller.lora_adapters
