"""HF checkpoint -> Megatron TP=2 x PP=2 -> HF is bitwise identical (Llama GQA untied, Qwen2
bias + tied embeddings, Qwen3 q/k norm), including the sharded-file + index layout; also for an
odd shape: vocab 333 (Megatron holds 512 padded rows, the export has 333) and 3 layers over 2
pipeline stages (uneven: [2, 1])."""
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


@pytest.mark.parametrize("shape", ["base", "odd"])
@pytest.mark.parametrize("arch", ARCHS)
def test_bitwise_roundtrip(results, arch, shape):
    r = results[f"{arch}/{shape}"]
    assert r["mismatch"] == [] and r["extra"] == []
    assert r["equal"] and r["config_equal"]
    assert "model.safetensors.index.json" in r["files"]
    assert sum(f.endswith(".safetensors") for f in r["files"]) > 2


@pytest.mark.parametrize("arch", ARCHS)
def test_odd_shape_is_padded_and_split_unevenly(results, arch):
    base, odd = results[f"{arch}/base"], results[f"{arch}/odd"]
    assert base["rows"] == 256 and odd["rows"] == 512  # 128 and 333 -> multiples of 128 * tp
    # ranks (tp, pp) in Megatron order: pp0 = ranks 0, 1; pp1 = ranks 2, 3
    assert base["layers"] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert odd["layers"] == [[0, 1], [0, 1], [2], [2]]
