"""LoRA on real megatron-core over gloo (tests/dist/lora_worker.py), TP=2 and PP=2:

- at init (B = 0) the LoRA model's logprobs equal the frozen base's exactly;
- with random nonzero B they equal a dense model whose weights are W + (alpha/r) B A, and they
  are the same under TP=2 and PP=2 (the adapters' init does not depend on the layout);
- one training step moves every adapter and no base weight, the optimizer holds only adapters,
  and the grad norm is the same under both layouts;
- the HF / PEFT form of the adapters (q/k/v and gate/up split, A shared) merged into the HF base
  by `merge_hf` gives transformers the same logprobs as the trainer."""
import json

import pytest
import torch
from safetensors.torch import load_file

from distrun import torchrun
from hf_models import load_safetensors, reference_logprobs
from megarl.models.lora import merge_hf
from megarl.models.random_hf import tiny_config, write_random_hf


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    hf = write_random_hf(str(tmp / "hf"), tiny_config("LlamaForCausalLM"), seed=3)
    out = {}
    for tp, pp in ((2, 1), (1, 2)):
        torchrun("lora_worker.py", 2, hf, tp, pp, tmp / f"o{tp}{pp}.json", tmp / f"a{tp}{pp}.safetensors")
        out[(tp, pp)] = json.loads((tmp / f"o{tp}{pp}.json").read_text())
    return hf, tmp, out


def test_lora_equals_base_at_init_and_dense_reference_after(runs):
    _, _, out = runs
    for layout, rows in out.items():
        assert len(rows) == 2
        for r in rows:
            assert r["init_diff"] == 0.0, layout
            assert r["lora_vs_base"] > 0.1, layout  # the random adapters change the model
            assert r["lora_vs_dense"] < 1e-5, layout
            assert r["export_undone"], layout
    tp2, pp2 = torch.tensor(out[(2, 1)][0]["logp"]), torch.tensor(out[(1, 2)][0]["logp"])
    assert (tp2 - pp2).abs().max() < 1e-5


def test_only_adapters_train(runs):
    _, _, out = runs
    norms = []
    for layout, rows in out.items():
        for r in rows:
            assert r["base_unchanged"], layout
            assert r["optimizer_params"] == r["adapter_params"] == r["adapters_moved"] > 0, layout
            norms.append(r["grad_norm"])
    # 4 layers x 4 targets x (A, B): all on each TP rank, half on each PP stage
    assert out[(2, 1)][0]["adapter_params"] == 32 and out[(1, 2)][0]["adapter_params"] == 16
    assert max(norms) - min(norms) < 1e-6 * max(norms)


def test_hf_form_merged_matches_trainer(runs):
    import transformers

    hf, tmp, out = runs
    adapters = load_file(str(tmp / "a21.safetensors"))
    assert len(adapters) == 4 * 7 * 2  # q k v o gate up down, A and B, 4 layers
    assert adapters["model.layers.0.self_attn.k_proj.lora_B.weight"].shape == (32, 4)  # 2 kv heads x 16
    assert torch.equal(adapters["model.layers.0.self_attn.q_proj.lora_A.weight"],
                       adapters["model.layers.0.self_attn.v_proj.lora_A.weight"])  # fused: A shared
    base = load_safetensors(hf)
    merged = {**base, **merge_hf(base, adapters, 8.0 / 4)}
    cfg = transformers.AutoConfig.from_pretrained(hf)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    model.load_state_dict(merged, strict=False)
    from layouts_worker import make_batch

    batch = make_batch()
    rows = [batch.tokens[i, : batch.lengths[i]].tolist() for i in range(len(batch))]
    ref = reference_logprobs(model, rows)
    logp = out[(2, 1)][0]["logp"]
    diff = max(abs(a - b) for i, r in enumerate(ref) for a, b in zip(r, logp[i]))
    assert diff < 1e-4
    # the trainer's own export (checkpoint.hf_export_dir): the merged model, which transformers
    # loads as is, and the PEFT adapter beside it; from TP=2 and from PP=2 (stages gathered)
    for layout in ("21", "12"):
        export = tmp / f"a{layout}.safetensors.export"
        merged_model = transformers.AutoModelForCausalLM.from_pretrained(str(export)).float().eval()
        exported = reference_logprobs(merged_model, rows)
        assert max(abs(a - b) for i, r in enumerate(exported) for a, b in zip(r, logp[i])) < 1e-4, layout
        cfg_json = json.loads((export / "adapter" / "adapter_config.json").read_text())
        assert cfg_json["peft_type"] == "LORA" and cfg_json["r"] == 4 and cfg_json["lora_alpha"] == 8.0
        assert cfg_json["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                     "up_proj", "down_proj"])
        peft = load_file(str(export / "adapter" / "adapter_model.safetensors"))
        assert set(peft) == {f"base_model.model.{k}" for k in adapters}
        for k, v in adapters.items():
            assert torch.equal(peft[f"base_model.model.{k}"], v), k


def test_checkpoint_resumes_adapters_and_their_adam_state(tmp_path):
    """TP=2, LoRA with dropout: save at step 2, go on to 4; a fresh engine resumed from step 2 goes
    to 4 again. Bitwise equal losses and final weights need the adapters and their Adam moments
    (a fresh Adam would take a different step 3) and the data position back."""
    from test_checkpoint import make_run_inputs

    make_run_inputs(str(tmp_path))
    torchrun("lora_ckpt_worker.py", 2, tmp_path)
    rows = json.loads((tmp_path / "out.json").read_text())
    for r in rows:
        assert r["start"] == 2 and r["n_adapters"] == 2 * 4 * 2  # 2 layers x 4 targets x (A, B)
        assert r["restored_equal"] and r["restored_nonzero_B"]
        assert r["losses"] == {k: v for k, v in r["ref_losses"].items() if int(k) > 2}
        assert r["final_equal"]
