"""Parity tier: tiny random Llama (GQA), Qwen2 (qkv bias, tied embeddings), Qwen3 (q/k norm,
head_dim != hidden/heads) and Mistral (sliding-window attention, window 4 < the sequences) built
WITH transformers, all with an odd vocabulary (333: Megatron pads it to 384/512 rows) and 3 layers
(PP=2 splits them unevenly, [2, 1]); converted by megarl-convert (TP=2, PP=2, TP=2 x PP=2 and the
real console entry with its own torchrun relaunch), scored by megarl-logprobs at TP=1, TP=2 and
TP=2 x PP=2: per-token logprobs equal transformers' fp32 ones within 1e-4, and mcore-to-hf gives
the original safetensors bitwise (and loads in transformers with equal logits)."""
import json
import os
import random
import subprocess
import sys

import pytest
import torch

from distrun import HERE, torchrun
from hf_models import load_safetensors, reference_logprobs, save_random

transformers = pytest.importorskip("transformers")

ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
VOCAB = 333
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-6)


def build(arch: str, out: str):
    cfg = {"LlamaForCausalLM": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=False),
           "Qwen2ForCausalLM": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
           "Qwen3ForCausalLM": lambda: transformers.Qwen3Config(**COMMON, head_dim=32,
                                                                 tie_word_embeddings=False),
           "MistralForCausalLM": lambda: transformers.MistralConfig(**COMMON, sliding_window=4,
                                                                    tie_word_embeddings=False)}[arch]()
    return save_random(transformers, cfg, out, seed=ARCHS.index(arch))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("parity")
    rng = random.Random(0)
    rows = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 3, 7, 12, 20, 33)]
    rows[-1][5] = VOCAB - 1  # the last real id: on the TP shard where the padding starts
    with open(d / "input.jsonl", "w") as f:
        for i, ids in enumerate(rows):
            f.write(json.dumps({"id": i, "input_ids": ids}) + "\n")
    models, refs = {}, {}
    for arch in ARCHS:
        models[arch] = build(arch, str(d / arch / "hf"))
        refs[arch] = reference_logprobs(models[arch], rows)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # the real console entry: --tp 2 outside any launcher starts its own torchrun
    cli = subprocess.run([sys.executable, "-m", "megarl.commands.convert", "hf-to-mcore",
                          "--hf", str(d / ARCHS[0] / "hf"), "--out", str(d / ARCHS[0] / "mcore"),
                          "--tp", "2"], capture_output=True, text=True, env=env, timeout=600)
    assert cli.returncode == 0, cli.stderr[-4000:]
    torchrun("ckpt_parity_worker.py", 4, d, "ranks4")
    single = subprocess.run([sys.executable, os.path.join(HERE, "ckpt_parity_worker.py"), str(d), "single"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert single.returncode == 0, single.stdout[-2000:] + single.stderr[-4000:]
    return d, rows, models, refs, cli


def test_sliding_window_matters(work):
    """The Mistral reference really uses its window: full attention gives other logprobs (equal
    only on the first 4 positions, which see no further back than the window anyway)."""
    d, rows, models, refs, _ = work
    model = models["MistralForCausalLM"]
    full = transformers.AutoModelForCausalLM.from_config(
        transformers.MistralConfig(**COMMON, sliding_window=None, tie_word_embeddings=False),
        attn_implementation="eager").float().eval()
    full.load_state_dict(model.state_dict())
    ref_full = reference_logprobs(full, rows)
    assert max(abs(a - b) for a, b in zip(ref_full[-1], refs["MistralForCausalLM"][-1])) > 1e-2
    assert ref_full[-1][:4] == pytest.approx(refs["MistralForCausalLM"][-1][:4], abs=1e-6)


def read_logprobs(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", ["tp1", "tp2", "tp2pp2"])
def test_logprobs_match_transformers(work, arch, layout):
    d, rows, _, refs, _ = work
    got = read_logprobs(d / arch / f"{layout}.jsonl")
    assert [g["id"] for g in got] == list(range(len(rows)))
    assert [g["input_ids"] for g in got] == rows
    for g, ref in zip(got, refs[arch]):
        assert len(g["logprobs"]) == len(ref) and g["logprobs"][0] == 0.0
        assert max(abs(a - b) for a, b in zip(g["logprobs"], ref)) <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_mcore_to_hf_loads_in_transformers_with_equal_logits(work, arch):
    d, rows, models, _, _ = work
    back = transformers.AutoModelForCausalLM.from_pretrained(str(d / arch / "hf_back"),
                                                             attn_implementation="eager").float().eval()
    ids = torch.tensor([rows[-1]])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, models[arch](ids).logits)
    original, back = load_safetensors(d / arch / "hf"), load_safetensors(d / arch / "hf_back")
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[k], original[k]) for k in original)  # bitwise, original vocab rows
    assert back["model.embed_tokens.weight"].shape[0] == VOCAB
    files = set(os.listdir(d / arch / "hf_back"))
    sharded = arch == "Qwen2ForCausalLM"  # written with --max-shard-size 60KB
    assert "config.json" in files
    assert ("model.safetensors.index.json" in files) == sharded
    assert ("model.safetensors" in files) != sharded


def test_converted_checkpoint_layout(work):
    d, _, _, _, cli = work
    mc = d / ARCHS[0] / "mcore"
    meta = json.loads((mc / "megarl.json").read_text())
    assert meta["kind"] == "converted" and meta["complete"] and meta["layout"] == {"tp": 2, "pp": 1}
    assert (meta["vocab_size"], meta["padded_vocab_size"]) == (VOCAB, 512)
    assert {"config.json", "metadata.json", ".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(mc))
    assert "hf-to-mcore:" in cli.stdout  # progress lines
    assert not any(n.startswith(".tmp-") for arch in ARCHS for n in os.listdir(d / arch))
