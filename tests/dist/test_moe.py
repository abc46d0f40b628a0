"""Qwen3-MoE through Megatron's MoE layers on CPU (SequentialMLP experts, alltoall token dispatcher
over gloo, expert parallelism): tiny random models built WITH transformers (4 experts, top-2,
vocab 333, 3 layers; routing with and without top-k renormalisation), converted by megarl-convert
(PP=2), scored by megarl-logprobs at EP=1, EP=2 and PP=2 x EP=2 (per-token logprobs equal
transformers' fp32 ones within 1e-4); mcore-to-hf (of the converted checkpoint and of one saved at
PP=2 x EP=2), the HF export and the resharder's buckets at EP=2 give the original tensors bitwise; training at EP=2 (and PP=2 x EP=2) gives the EP=1 loss,
grad norm and post-step logprobs."""
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

MODELS = {"norm": True, "nonorm": False}  # norm_topk_prob
VOCAB = 333


def build(out: str, norm_topk: bool, seed: int):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=128, norm_topk_prob=norm_topk, tie_word_embeddings=False,
        rms_norm_eps=1e-6)
    return save_random(transformers, cfg, out, seed)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    rng = random.Random(0)
    rows = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 7, 12, 20, 33, 9, 5, 17)]
    with open(d / "input.jsonl", "w") as f:
        for ids in rows:
            f.write(json.dumps({"input_ids": ids}) + "\n")
    refs = {}
    for i, (name, norm) in enumerate(MODELS.items()):
        refs[name] = reference_logprobs(build(str(d / name / "hf"), norm, seed=10 + i), rows)
    # the same launch then trains the "norm" model under the EP layouts of `training`
    torchrun("moe_worker.py", 4, d, "ranks4", *MODELS, "+", d / "norm" / "hf", d / "train.json",
             TRAIN_REF, *TRAIN_LAYOUTS)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    single = subprocess.run([sys.executable, os.path.join(HERE, "moe_worker.py"), str(d), "single", *MODELS],
                            capture_output=True, text=True, env=env, timeout=600)
    assert single.returncode == 0, single.stdout[-2000:] + single.stderr[-4000:]
    return d, rows, refs


TRAIN_REF, TRAIN_LAYOUTS = "1,1,4096,0", ["1,1,4096,0,2", "1,2,4096,0,2", "1,1,4096,1,2"]


@pytest.fixture(scope="module")
def training(work):
    """layouts_worker results of the "norm" model: EP=1 reference, EP=2, PP=2 x EP=2, EP=2 with the
    distributed optimizer (run by `work`'s launch)."""
    return TRAIN_REF, TRAIN_LAYOUTS, json.loads((work[0] / "train.json").read_text())


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("layout", ["ep1", "ep2", "pp2ep2"])
def test_logprobs_match_transformers(work, name, layout):
    d, rows, refs = work
    with open(d / name / f"{layout}.jsonl") as f:
        got = [json.loads(line)["logprobs"] for line in f]
    assert len(got) == len(rows)
    err = max(abs(a - b) for g, r in zip(got, refs[name]) for a, b in zip(g, r))
    assert err <= 1e-4


def test_routing_variants_differ(work):
    """norm_topk_prob really changes the model (so both router mappings are exercised)."""
    d, rows, refs = work
    assert max(abs(a - b) for a, b in zip(refs["norm"][-1], refs["nonorm"][-1])) > 1e-3


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("what", ["hf_back", "export_pp1ep2", "export_pp2ep2", "reshard_pp1ep2",
                                  "reshard_pp2ep2", "saved_back"])
def test_experts_come_back_bitwise(work, name, what):
    d = work[0]
    original, got = load_safetensors(d / name / "hf"), load_safetensors(d / name / what)
    assert sorted(got) == sorted(original)
    assert all(torch.equal(got[k], original[k]) for k in original)
    assert got["model.layers.2.mlp.experts.3.down_proj.weight"].shape == (64, 32)


def test_converted_checkpoint_stacks_layers_and_experts(work):
    from megarl.commands.conversion import tensor_metadata

    meta = tensor_metadata(str(work[0] / "norm" / "mcore"))
    assert meta["decoder.layers.mlp.experts.experts.linear_fc1.weight"][0] == (3, 4, 64, 64)
    assert meta["decoder.layers.mlp.experts.experts.linear_fc2.weight"][0] == (3, 4, 64, 32)
    assert meta["decoder.layers.mlp.router.weight"][0] == (3, 4, 64)


def test_expert_parallel_training_matches_ep1(training):
    ref_spec, layouts, results = training
    ref = results[ref_spec]
    assert 5.0 < ref["loss"] < 7.0
    for spec in layouts:
        got = results[spec]
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), spec
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), spec
        diff = max(abs(x - y) for a, b in zip(got["logp_after"], ref["logp_after"]) for x, y in zip(a, b))
        assert diff <= 5e-5, spec
    moved = max(abs(x - y) for a, b in zip(ref["logp_after"], ref["logp"]) for x, y in zip(a, b))
    assert moved > 1e-3
