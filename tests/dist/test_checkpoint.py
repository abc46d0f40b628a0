"""Checkpoint save / kill / resume through the SFT path on a tiny random Llama (2 gloo ranks):
resuming is bitwise equal to an uninterrupted run (same layout), within 1e-5 after switching
TP=1 x DP=2 -> TP=2; a kill during a save leaves only a temp directory that resume never picks."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from distrun import HERE, free_port, torchrun
from megarl.checkpoint import LATEST, find_latest, is_complete, read_meta
from megarl.data.datasets import read_jsonl
from megarl.data.tasks import write_addition_corpus
from megarl.common.tokenizer import train_sentencepiece


def make_run_inputs(work: str) -> None:
    """Addition corpus, char tokenizer and a 2-layer hidden-64 Llama config (random init)."""
    paths = write_addition_corpus(work, digits=2, n_sft=200, n_rl=10, n_eval=10, seed=0)
    os.replace(paths["sft"], os.path.join(work, "sft.jsonl"))
    texts = [r["prompt"] + r["response"] for _, r in read_jsonl(os.path.join(work, "sft.jsonl"))]
    tok = train_sentencepiece(texts, os.path.join(work, "hf"), vocab_size=64, required_chars="0123456789+=")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "torch_dtype": "float32"}
    assert tok.vocab_size <= config["vocab_size"]
    with open(os.path.join(work, "hf", "config.json"), "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    make_run_inputs(str(d))
    # launch 1: reference run, then a run killed while writing step 6 (non-zero exit expected)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           os.path.join(HERE, "ckpt_worker.py"), str(d), "train"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if not (d / "ref.json").exists() or not (d / "killed_rank0").exists():
        pytest.fail(f"train launch failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-6000:]}")
    assert proc.returncode != 0
    snapshot = {"crash": sorted(os.listdir(d / "crash")),
                "tmp": sorted(os.listdir(d / "crash" / ".tmp-step_00000006"))}
    # launch 2: an async-save run killed in its writer thread while saving step 6
    proc = subprocess.run(cmd[:-1] + ["async_kill"], capture_output=True, text=True, timeout=600, env=env)
    if not (d / "async_killed_rank0").exists():
        pytest.fail(f"async_kill launch failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
    snapshot["async_crash"] = sorted(os.listdir(d / "async_crash"))
    torchrun("ckpt_worker.py", 2, d, "resume")  # launch 3
    return d, snapshot


def hf_tensors(path):
    return load_file(os.path.join(path, "model.safetensors"))


def test_killed_save_leaves_only_a_temp_dir(work):
    d, snapshot = work
    assert snapshot["crash"] == [".tmp-step_00000006", LATEST, "step_00000003"]
    # the killed save had written its tensors (it even looks like a Megatron checkpoint), but it
    # was never committed: no megarl.json, never renamed, so resume skipped it (test below)
    assert {".metadata", "metadata.json", "common.pt"} <= set(snapshot["tmp"])
    assert "megarl.json" not in snapshot["tmp"]


def test_resume_after_kill_is_bitwise_equal(work):
    d, _ = work
    ref = json.loads((d / "ref.json").read_text())["losses"]
    a = json.loads((d / "resume.json").read_text())["A"]
    assert a["start"] == 3 and a["from"].endswith("crash/step_00000003")
    assert a["policy_version"] == 103 and a["engine_step"] == 3
    assert a["sampler"]["position"] == 24  # 3 steps x 8 samples, restored from megarl.json
    assert a["losses"] == {k: ref[k] for k in ("4", "5", "6")}  # bitwise (JSON floats round-trip)
    want, got = hf_tensors(d / "ref_hf"), hf_tensors(d / "A_hf")
    assert set(want) == set(got)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_resume_with_tp2_from_tp1_checkpoint(work):
    d, _ = work
    ref = json.loads((d / "ref.json").read_text())["losses"]
    b = json.loads((d / "resume.json").read_text())["B"]
    assert b["start"] == 3
    for k in ("4", "5", "6"):
        assert abs(b["losses"][k] - ref[k]) <= 1e-5
    want, got = hf_tensors(d / "ref_hf"), hf_tensors(d / "B_hf")
    assert max((want[k] - got[k]).abs().max().item() for k in want) <= 1e-5


def test_context_parallel_resumes_across_cp_sizes(work):
    """D: a CP=2 run resumed from the CP=1 x DP=2 reference's step 3 trains steps 4-6 like the
    reference; E: its CP=2 step-6 checkpoint loaded at CP=1 x DP=2 holds exactly its weights."""
    d, _ = work
    ref = json.loads((d / "ref.json").read_text())["losses"]
    res = json.loads((d / "resume.json").read_text())
    assert res["D"]["start"] == 3 and res["E"]["start"] == 6
    for k in ("4", "5", "6"):
        assert abs(res["D"]["losses"][k] - ref[k]) <= 1e-5
    want, cp2, cp1 = hf_tensors(d / "ref_hf"), hf_tensors(d / "D_hf"), hf_tensors(d / "E_hf")
    assert max((want[k] - cp2[k]).abs().max().item() for k in want) <= 1e-5
    assert set(cp1) == set(cp2) and all(torch.equal(cp2[k], cp1[k]) for k in cp2)


def test_async_save_writes_what_the_synchronous_save_writes(work):
    """checkpoint.async_save: the same run, its checkpoints written by the writer thread while it
    trains on, gives the same losses and final weights, and the checkpoints it committed hold
    the same tensors as the synchronous run's."""
    d, _ = work
    ref = json.loads((d / "ref.json").read_text())["losses"]
    got = json.loads((d / "async.json").read_text())
    assert got["losses"] == ref and got["last_save_s"] > 0
    want, have = hf_tensors(d / "ref_hf"), hf_tensors(d / "async_hf")
    assert all(torch.equal(want[k], have[k]) for k in want)
    for step in ("step_00000003", "step_00000006"):  # each rank's shard file, byte for byte
        shards = sorted(p.name for p in (d / "ref" / step).glob("*.distcp"))
        assert shards == sorted(p.name for p in (d / "async" / step).glob("*.distcp")) and len(shards) == 2
        for name in shards:
            assert (d / "ref" / step / name).read_bytes() == (d / "async" / step / name).read_bytes(), (step, name)


def test_a_kill_during_a_background_save_resumes_from_the_previous_checkpoint(work):
    d, snapshot = work
    assert snapshot["async_crash"] == [".tmp-step_00000006", LATEST, "step_00000003"]
    ref = json.loads((d / "ref.json").read_text())["losses"]
    g = json.loads((d / "resume.json").read_text())["G"]
    assert g["start"] == 3 and g["from"].endswith("async_crash/step_00000003")
    assert g["losses"] == {k: ref[k] for k in ("4", "5", "6")}


def test_plain_optimizer_pp2_resume_is_bitwise(work):
    c = json.loads((work[0] / "resume.json").read_text())["C"]
    assert c["start"] == 2 and c["ref"] == c["got"] and c["params_equal"]


def test_directory_layout_retention_and_latest(work):
    d, _ = work
    crash = d / "crash"
    # keep_last=1: step 3 retired after step 6; the stale temp dir is gone; the planted
    # incomplete step_00000009 is never chosen (and never deleted: it is not ours)
    assert sorted(os.listdir(crash)) == [LATEST, "step_00000006", "step_00000009"]
    assert (crash / LATEST).read_text() == "step_00000006\n"
    assert find_latest(str(crash)) == str(crash / "step_00000006")
    assert not is_complete(str(crash / "step_00000009"))
    step6 = crash / "step_00000006"
    files = set(os.listdir(step6))
    assert {"metadata.json", ".metadata", "common.pt", "megarl.json", "config.json",
            "tokenizer.model", "rng"} <= files
    assert sorted(os.listdir(step6 / "rng")) == ["rank_00000.safetensors", "rank_00001.safetensors"]
    meta = read_meta(str(step6))
    assert meta["step"] == 6 and meta["policy_version"] == 106 and meta["kind"] == "training"
    assert meta["layout"] == {"tp": 1, "pp": 1, "dp": 2, "vpp": None, "world_size": 2}
    assert meta["state"]["data"]["sampler"]["position"] == 48
    # keep_last=2 in the reference run: both checkpoints stay
    assert sorted(os.listdir(d / "ref")) == [LATEST, "step_00000003", "step_00000006"]
