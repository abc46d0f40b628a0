"""megarl-server's LoRA merge (megarl/server/lora.py) on the real CPU model: W = W0 + s B A from the
kept base on every adapter push (never accumulated), a full tensor replaces the base, halves of a
module in different buckets, and bad adapters refused naming the tensor with nothing written."""
import pytest
import torch
from test_server_reference import make_tiny_model

from megarl.server.lora import SCALING, LoRAState
from megarl.server.model import CausalLM, DecoderConfig
from megarl.server.weights import read_hf_dir

Q = "model.layers.1.self_attn.q_proj"
DOWN = "model.layers.0.mlp.down_proj"


@pytest.fixture
def model(tmp_path):
    make_tiny_model(tmp_path / "m", layers=2)
    m = CausalLM(DecoderConfig.from_dir(str(tmp_path / "m")), torch.float32, max_len=64)
    m.load(read_hf_dir(str(tmp_path / "m")))
    return m


def push(state, model, tensors):
    to_load, commit = state.prepare(model, tensors)
    model.load(to_load)
    commit()
    return to_load


def adapters(mod, out, inp, r=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"{mod}.lora_A.weight": torch.randn(r, inp, generator=g), f"{mod}.lora_B.weight": torch.randn(out, r, generator=g)}


def test_merge_is_from_the_base_every_push(model):
    state = LoRAState()
    w0 = model.full_param(f"{Q}.weight").clone()
    d0 = model.full_param(f"{DOWN}.weight").clone()
    first = {SCALING: torch.tensor([2.0]), **adapters(Q, 64, 64, seed=1), **adapters(DOWN, 64, 128, seed=2)}
    push(state, model, first)
    want = w0 + 2.0 * first[f"{Q}.lora_B.weight"] @ first[f"{Q}.lora_A.weight"]
    assert torch.allclose(model.full_param(f"{Q}.weight"), want, atol=1e-5)
    second = {SCALING: torch.tensor([0.5]), **adapters(Q, 64, 64, seed=3)}
    push(state, model, second)
    want = w0 + 0.5 * second[f"{Q}.lora_B.weight"] @ second[f"{Q}.lora_A.weight"]
    assert torch.allclose(model.full_param(f"{Q}.weight"), want, atol=1e-5)  # not on top of the first
    # down_proj kept its first adapter, now under the new scale
    dwant = d0 + 0.5 * first[f"{DOWN}.lora_B.weight"] @ first[f"{DOWN}.lora_A.weight"]
    assert torch.allclose(model.full_param(f"{DOWN}.weight"), dwant, atol=1e-5)
    assert torch.equal(state.held(f"{Q}.lora_A.weight"), second[f"{Q}.lora_A.weight"])


def test_full_tensor_replaces_the_base_and_halves_may_come_apart(model):
    state = LoRAState()
    ad = adapters(Q, 64, 64, seed=4)
    push(state, model, {SCALING: torch.tensor([1.0]), f"{Q}.lora_A.weight": ad[f"{Q}.lora_A.weight"]})
    w0 = model.full_param(f"{Q}.weight").clone()  # only A so far: nothing merged
    push(state, model, {f"{Q}.lora_B.weight": ad[f"{Q}.lora_B.weight"]})
    ba = ad[f"{Q}.lora_B.weight"] @ ad[f"{Q}.lora_A.weight"]
    assert torch.allclose(model.full_param(f"{Q}.weight"), w0 + ba, atol=1e-5)
    new_base = torch.randn(64, 64)
    push(state, model, {f"{Q}.weight": new_base})
    assert torch.allclose(model.full_param(f"{Q}.weight"), new_base + ba, atol=1e-5)


@pytest.mark.parametrize("tensors,match", [
    ({f"{Q}.lora_A.weight": torch.zeros(4, 64), f"{Q}.lora_B.weight": torch.zeros(64, 4)}, "lora.scaling"),
    ({SCALING: torch.tensor([1.0]), f"{Q}.lora_A.weight": torch.zeros(4, 32),
      f"{Q}.lora_B.weight": torch.zeros(64, 4)}, Q),
    ({SCALING: torch.tensor([1.0]), "model.layers.9.x_proj.lora_A.weight": torch.zeros(4, 64),
      "model.layers.9.x_proj.lora_B.weight": torch.zeros(64, 4)}, "x_proj"),
])
def test_bad_adapters_are_refused_and_change_nothing(model, tensors, match):
    state = LoRAState()
    before = model.full_param(f"{Q}.weight").clone()
    with pytest.raises((KeyError, ValueError), match=match):
        state.prepare(model, tensors)
    assert torch.equal(model.full_param(f"{Q}.weight"), before)
    assert state.scaling is None and not state.adapters and not state.bases
