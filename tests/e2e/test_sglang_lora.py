"""LoRA RL against real SGLang (0.5.23, CPU, fp32; `sglang` marker).

1. SGLang's own LoRA path, as megarl-train launches it (the flags of `megarl.config.server_flags.feature_flags`,
   the stand-in's CPU fix `sgl_kernel_cpu/sgl_kernel/_lora_cpu.py`): a PEFT adapter loaded with
   /load_lora_adapter and selected per request with ``lora_path`` gives the logprobs of
   transformers on the merged weights W + (alpha/r) B A; requests without ``lora_path`` keep the
   base's.
2. `megarl-train` with ``lora.rank > 0`` and ``rollout.engine=sglang`` (TP=1): every push
   after the base writes the adapters as a PEFT directory that each server loads as
   ``megarl-policy-v<version>`` (and unloads the previous one), every request names it, the
   pushed bytes are exactly the adapters', and the trainer's logprobs of SGLang's tokens stay
   within the fp32 mismatch gate while the adapters move the model far from its base (so a server
   that ignored them would fail the gate).

MEGARL_SKIP_SGLANG=1 skips the tier.
"""
import json
import os
import sys
import urllib.request

import pytest
import torch
from safetensors.torch import load_file, save_file
from sglang_runs import REPO, demo_model, received, require_sglang, train

pytestmark = pytest.mark.sglang

IDS = [1, 5, 6, 7, 3, 9, 2, 4, 4, 8, 10, 11, 12, 3]  # BOS, "12+34=46", ... (the demo's id space)
HF_MODULES = {"self_attn.q_proj": ("h", "q"), "self_attn.k_proj": ("h", "kv"), "self_attn.v_proj": ("h", "kv"),
              "self_attn.o_proj": ("q", "h"), "mlp.gate_proj": ("h", "i"), "mlp.up_proj": ("h", "i"),
              "mlp.down_proj": ("i", "h")}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    require_sglang()
    return demo_model(str(tmp_path_factory.mktemp("sglang_lora") / "model"))


def _random_adapter(path, model_dir: str, rank: int, alpha: float) -> None:
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    dims = {"h": cfg["hidden_size"], "i": cfg["intermediate_size"],
            "q": cfg["num_attention_heads"] * cfg["head_dim"], "kv": cfg["num_key_value_heads"] * cfg["head_dim"]}
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (fan_in, fan_out) in HF_MODULES.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, dims[fan_in], generator=g) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(dims[fan_out], rank, generator=g) * 0.1
    os.makedirs(path)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    targets = sorted(m.split(".")[1] for m in HF_MODULES)
    json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets, "bias": "none",
               "task_type": "CAUSAL_LM", "lora_dropout": 0.0}, open(os.path.join(path, "adapter_config.json"), "w"))


def _hf_logprobs(model_dir: str, ids: list[int], adapter_dir=None) -> torch.Tensor:
    """transformers fp32 logprobs of ids[1:]; with ``adapter_dir`` on W + (alpha/r) B A."""
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    if adapter_dir is not None:
        ad = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
        acfg = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
        scale = acfg["lora_alpha"] / acfg["r"]
        sd = m.state_dict()
        for key in ad:
            if key.endswith(".lora_A.weight"):
                base = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"
                sd[base] = sd[base] + scale * ad[key.replace("lora_A", "lora_B")] @ ad[key]
        m.load_state_dict(sd)
    with torch.no_grad():
        logp = torch.log_softmax(m(torch.tensor([ids])).logits[0, :-1], -1)
    return logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_sglang_lora_path_equals_merged_weights(tmp_path, model):
    sys.path.insert(0, os.path.join(REPO, "tools", "sglang_cpu"))
    from launch import SGLangServer  # tools/sglang_cpu/launch.py

    from megarl.config import load_config
    from megarl.config.server_flags import feature_flags

    cfg = load_config(os.path.join(REPO, "configs", "tiny_grpo_lora.yaml"),
                      ["rollout.engine=sglang", "lora.rank=8", "lora.alpha=16"])
    flags = feature_flags(cfg, "sglang", gpu=False)  # what megarl-train starts its SGLang servers with
    assert flags[:5] == ["--enable-lora", "--max-lora-rank", "8", "--max-loras-per-batch", "2"]
    adapter = tmp_path / "adapter"
    _random_adapter(str(adapter), model, rank=8, alpha=16)
    server = SGLangServer(model, python=require_sglang(), log_path=str(tmp_path / "sglang.log"), extra=flags)

    def post(path, body):
        req = urllib.request.Request(server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def logprobs(lora_path=None):
        body = {"input_ids": IDS, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                "return_logprob": True, "logprob_start_len": 0, **({"lora_path": lora_path} if lora_path else {})}
        return torch.tensor([x[0] for x in post("/generate", body)["meta_info"]["input_token_logprobs"][1:]])

    try:
        server.start().wait_ready(timeout=400)
        assert post("/load_lora_adapter", {"lora_name": "megarl-policy-v1", "lora_path": str(adapter)})["success"]
        served_base, served_lora = logprobs(), logprobs("megarl-policy-v1")
        assert post("/unload_lora_adapter", {"lora_name": "megarl-policy-v1"})["success"]
    finally:
        server.stop()
    base, merged = _hf_logprobs(model, IDS), _hf_logprobs(model, IDS, str(adapter))
    err_base, err_lora = (served_base - base).abs().max().item(), (served_lora - merged).abs().max().item()
    effect = (merged - base).abs().max().item()
    print(f"\n[sglang-lora] |SGLang - transformers|: base {err_base:.2e}, adapter {err_lora:.2e} "
          f"(the adapter moves logprobs by up to {effect:.2f})")
    assert err_base < 1e-5 and err_lora < 1e-5  # measured 1.1e-7 and 4.8e-6
    assert effect > 1.0


# TP=1 only: the PEFT directory a push writes is the same at any TP (the adapters are gathered
# first; tests/e2e/test_train_lora.py checks TP=2's gathered adapters and exports), and each SGLang
# run costs ~40 s of the CI budget
@pytest.mark.parametrize("tp", [1])
def test_lora_train_against_sglang_loads_each_adapter(tmp_path, model, tp):
    from megarl.models.lora import hf_adapter_shapes
    from megarl.protocol.hf_model import read_model_args

    run, steps = str(tmp_path / "run"), 4
    done = train(run, model, "data.eval_path=", "rollout.eval_at_start=false", "checkpoint.save_interval=0",
                 f"train.steps={steps}", "train.global_batch_size=32", "rollout.max_staleness=0",
                 f"parallel.tp={tp}", "lora.rank=8", "lora.alpha=16", "optim.lr=1e-2", "optim.lr_warmup_steps=0",
                 recipe="tiny_grpo_lora.yaml", timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = done.rows
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    shapes = hf_adapter_shapes(read_model_args(model), ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], 8)
    adapters = sum(r * c for r, c in shapes.values()) * 4  # fp32; the scale travels in adapter_config.json
    for r in rows:
        assert r["push/bytes"] == r["push/adapter_bytes"] == adapters, r  # the frozen base went once, at start
        assert r["mismatch/onpolicy_frac"] == 1.0
        assert r["mismatch/mean"] <= 1e-5 and r["mismatch/max"] <= 1e-4, r
    # one load per push (the start's and one per step), each previous adapter unloaded
    (log, counts), = received(run).items()
    assert counts.get("POST /load_lora_adapter 200") == steps + 1, counts
    assert counts.get("POST /unload_lora_adapter 200") == steps, counts
    assert os.listdir(os.path.join(run, "lora_adapters")) == [f"v{steps}"]
    # the adapters SGLang served moved the model: a server that ignored them would be this far off
    final = os.path.join(run, "lora_adapters", f"v{steps}")
    effect = (_hf_logprobs(model, IDS, final) - _hf_logprobs(model, IDS)).abs().max().item()
    print(f"\n[sglang-lora] tp={tp}: mismatch/max {max(r['mismatch/max'] for r in rows):.2e} with adapters "
          f"moving logprobs by up to {effect:.3f}")
    assert effect > 0.1  # measured 3.08; the gate allows 1e-4
