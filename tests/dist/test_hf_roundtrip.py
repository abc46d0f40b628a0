"""HF checkpoint -> Megatron TP=2 x PP=2 -> HF is bitwise identical (Llama GQA untied, Qwen2
bias + tied embeddings, Qwen3 q/k norm), including the sharded-file + index layout."""
import json

import pytest

from distrun import torchrun

ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("roundtrip")
    out = d / "results.json"
    torchrun("roundtrip_worker.py", 4, d, out, 2, 2, 60000)  # 60 kB files: forces an index
    return json.loads(out.read_text())


@pytest.mark.parametrize("arch", ARCHS)
def test_bitwise_roundtrip(results, arch):
    r = results[arch]
    assert r["mismatch"] == [] and r["extra"] == []
    assert r["equal"] and r["config_equal"]
    assert "model.safetensors.index.json" in r["files"]
    assert sum(f.endswith(".safetensors") for f in r["files"]) > 2
