"""SGLang's /load_lora_adapter and /unload_lora_adapter, driven by the manager's real AdminClient
against a real megarl-server: a PEFT adapter directory is merged into the served weights
(W0 + lora_alpha/r B A, from the base every time), another load replaces it, unload brings W0 back;
a path outside the server's weight roots is refused naming lora_path."""
import asyncio
import json

import pytest
import torch
from e2e_servers import http
from safetensors.torch import save_file

from megarl.rollout.admin import AdminClient
from megarl.rollout.http import AdminError

Q, DOWN = "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"


def write_peft(d, r, alpha, seed, shapes):
    g = torch.Generator().manual_seed(seed)
    d.mkdir()
    tensors = {}
    for mod, (out, inp) in shapes.items():
        tensors[f"base_model.model.{mod}.lora_A.weight"] = torch.randn(r, inp, generator=g)
        tensors[f"base_model.model.{mod}.lora_B.weight"] = torch.randn(out, r, generator=g)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": alpha,
                                                       "target_modules": ["q_proj", "down_proj"]}))
    return {k.removeprefix("base_model.model."): v for k, v in tensors.items()}


def weight(url, name):
    code, out = http("POST", url + "/get_weights_by_name", {"name": name, "truncate_size": 10_000})
    assert code == 200, out
    return torch.tensor(out)


def call(url, fn):
    async def go():
        c = AdminClient([url])
        try:
            return await fn(c)
        finally:
            await c.close()

    return asyncio.run(go())


def test_load_replace_unload_adapter(tiny_model, start_server, tmp_path):
    model_dir, sd = tiny_model
    server = start_server(model_dir)
    w0, d0 = sd[f"{Q}.weight"].float(), sd[f"{DOWN}.weight"].float()
    shapes = {Q: tuple(w0.shape), DOWN: tuple(d0.shape)}
    a1 = write_peft(tmp_path / "a1", 4, 8.0, 1, shapes)
    call(server.url, lambda c: c.load_lora_adapter("a1", str(tmp_path / "a1")))
    want = w0 + 2.0 * a1[f"{Q}.lora_B.weight"] @ a1[f"{Q}.lora_A.weight"]
    assert torch.allclose(weight(server.url, f"{Q}.weight"), want, atol=1e-4)
    a2 = write_peft(tmp_path / "a2", 2, 1.0, 2, shapes)
    call(server.url, lambda c: c.load_lora_adapter("a2", str(tmp_path / "a2")))
    want = d0 + 0.5 * a2[f"{DOWN}.lora_B.weight"] @ a2[f"{DOWN}.lora_A.weight"]
    assert torch.allclose(weight(server.url, f"{DOWN}.weight"), want, atol=1e-4)  # from W0, not on a1
    with pytest.raises(AdminError, match="a1"):
        call(server.url, lambda c: c.unload_lora_adapter("a1"))
    call(server.url, lambda c: c.unload_lora_adapter("a2"))
    assert torch.allclose(weight(server.url, f"{Q}.weight"), w0, atol=1e-6)
    assert torch.allclose(weight(server.url, f"{DOWN}.weight"), d0, atol=1e-6)
    with pytest.raises(AdminError, match="lora_path"):
        call(server.url, lambda c: c.load_lora_adapter("x", "/etc"))
