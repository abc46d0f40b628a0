"""Damaged checkpoints on real megatron-core checkpoints (the real entry, `python -m megarl.train`,
SFT on the tiny model, one rank): `verify_checkpoint` names the damaged file for each kind of
damage, `find_resumable` passes a damaged newest checkpoint over for the newest intact one, a
resume does that in a real run (one line saying which and why) and cuts every per-step log back
to what it held at the checkpoint; a model of another size fails on its ranks, naming the tensor
and both shapes."""
import json
import os
import shutil
import subprocess
import sys

import pytest

import harness
from distrun import free_port
from megarl.checkpoint import CheckpointError, find_resumable, verify_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARD, STEP1, STEP2 = "__0_0.distcp", "step_00000001", "step_00000002"


def train(run_dir, steps, *extra, check=True) -> harness.Run:
    """The tiny SFT recipe for ``steps`` steps, a checkpoint every step (all kept)."""
    run = harness.train(run_dir, f"train.steps={steps}", "train.global_batch_size=8", "checkpoint.save_interval=1",
                        "checkpoint.keep_last=5", *extra, recipe="tiny_sft.yaml", model=harness.TINY / "hf",
                        data=harness.TINY / "data" / "sft.jsonl", timeout=300,
                        env={"PYTHONWARNINGS": "ignore", "MASTER_PORT": str(free_port()), "PYTHONPATH": REPO})
    return run.check() if check else run


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run dir with real checkpoints at steps 1 and 2 (never modified: tests damage copies)."""
    run = str(tmp_path_factory.mktemp("damage") / "run")
    train(run, 2)
    return run


def copy_of(saved, tmp_path):
    dst = str(tmp_path / "ckpts")
    shutil.copytree(os.path.join(saved, "checkpoints"), dst)
    return dst


def _edit_meta(ckpt, fn):
    path = os.path.join(ckpt, "megarl.json")
    meta = json.load(open(path))
    fn(meta)
    json.dump(meta, open(path, "w"))


def _flip_tail(path):
    """Inverts 8 bytes near the end (tensor data: the file still parses, with other values)."""
    with open(path, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        data = f.read(8)
        f.seek(-100, os.SEEK_END)
        f.write(bytes(255 - b for b in data))


DAMAGE = {  # what is done to step 2 -> (file the error names, words in it)
    "shard_truncated": (lambda d: os.truncate(os.path.join(d, SHARD), 1000), SHARD, "1000 bytes"),
    "shard_deleted": (lambda d: os.remove(os.path.join(d, SHARD)), SHARD, "missing"),
    "common_missing": (lambda d: os.remove(os.path.join(d, "common.pt")), "common.pt", "missing"),
    "index_missing": (lambda d: os.remove(os.path.join(d, ".metadata")), ".metadata", "missing"),
    "rng_missing": (lambda d: os.remove(os.path.join(d, "rng", "rank_00000.safetensors")),
                    "rank_00000.safetensors", "missing"),
    "rng_altered": (lambda d: _flip_tail(os.path.join(d, "rng", "rank_00000.safetensors")),
                    "rank_00000.safetensors", "CRC32"),
    # a checkpoint from before the manifest: the DCP index still finds a short shard
    "shard_truncated_no_manifest": (lambda d: (_edit_meta(d, lambda m: m.pop("files")),
                                               os.truncate(os.path.join(d, SHARD), 1000)),
                                    SHARD, "the index needs 7631589"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_verify_names_the_damaged_file(kind, saved, tmp_path):
    ckpts = copy_of(saved, tmp_path)
    damage, name, words = DAMAGE[kind]
    verify_checkpoint(os.path.join(ckpts, STEP2))  # intact before
    damage(os.path.join(ckpts, STEP2))
    with pytest.raises(CheckpointError) as e:
        verify_checkpoint(os.path.join(ckpts, STEP2))
    msg = str(e.value)
    assert os.path.join(ckpts, STEP2) in msg and name in msg and words in msg, msg
    assert "\n" not in msg
    path, notes = find_resumable(ckpts)
    assert path == os.path.join(ckpts, STEP1)
    assert len(notes) == 1 and notes[0].startswith(f"{STEP2} is damaged (") and name in notes[0], notes


def test_manifest_records_every_file(saved):
    meta = json.load(open(os.path.join(saved, "checkpoints", STEP2, "megarl.json")))
    files = meta["files"]
    assert {SHARD, ".metadata", "common.pt", "metadata.json", "rng/rank_00000.safetensors",
            "config.json", "tokenizer.model"} == set(files)
    assert files[SHARD][0] == os.path.getsize(os.path.join(saved, "checkpoints", STEP2, SHARD))
    assert files[SHARD][1] is None and isinstance(files["common.pt"][1], int)  # CRC only <= 4 MiB
    assert meta["run_logs"]["run_dir"] == saved
    assert meta["run_logs"]["sizes"]["metrics.jsonl"] == len(
        "".join(open(os.path.join(saved, "metrics.jsonl")).readlines()[:2]).encode())


def test_latest_garbage_or_dangling_is_ignored_with_a_note(saved, tmp_path):
    ckpts = copy_of(saved, tmp_path)
    open(os.path.join(ckpts, "latest"), "wb").write(bytes(range(256)))
    path, notes = find_resumable(ckpts)
    assert path == os.path.join(ckpts, STEP2) and notes[0].startswith("latest ignored (holds b'"), notes
    open(os.path.join(ckpts, "latest"), "w").write("step_00000007\n")
    path, notes = find_resumable(ckpts)
    assert path == os.path.join(ckpts, STEP2) and "step_00000007" in notes[0], notes
    open(os.path.join(ckpts, "latest"), "w").write(f"{STEP1}\n")  # a valid hint is followed
    assert find_resumable(ckpts) == (os.path.join(ckpts, STEP1), [])


def test_none_intact_names_the_newest_damaged_file(saved, tmp_path):
    ckpts = copy_of(saved, tmp_path)
    os.remove(os.path.join(ckpts, STEP2, "common.pt"))
    os.truncate(os.path.join(ckpts, STEP1, SHARD), 10)
    with pytest.raises(CheckpointError) as e:
        find_resumable(ckpts)
    assert str(e.value) == (f"no intact checkpoint in {ckpts}: {ckpts}/{STEP2}/common.pt: missing "
                            f"(listed in {ckpts}/{STEP2}/megarl.json) (and 1 older one(s), also damaged)")
    assert find_resumable(str(tmp_path / "nothing")) == (None, [])


def test_resume_falls_back_and_rolls_back_every_per_step_log(tmp_path):
    run = str(tmp_path / "run")
    os.makedirs(os.path.join(run, "timeline"))
    # per-step logs another part of a run appends to; step 1's checkpoint records their sizes
    gen0 = '{"step": 0, "completion": "before"}\n'
    open(os.path.join(run, "generations.jsonl"), "w").write(gen0)
    open(os.path.join(run, "timeline", "rank0.jsonl"), "w").write('{"name": "a"}\n')
    train(run, 1, "checkpoint.resume=false")  # a fresh start that resumes would empty them
    train(run, 2)  # resumes at 1, saves 2; then step 2 "appends" to the logs
    open(os.path.join(run, "generations.jsonl"), "a").write('{"step": 2, "completion": "lost"}\n')
    open(os.path.join(run, "failed_prompts.jsonl"), "w").write('{"prompt_index": 3}\n')
    open(os.path.join(run, "timeline", "rank0.jsonl"), "a").write('{"name": "b"}\n{"na')  # torn
    os.truncate(os.path.join(run, "checkpoints", STEP2, SHARD), 1000)
    out = train(run, 3).stdout
    lines = [x for x in out.splitlines() if x.startswith("[checkpoint]")]
    assert lines[0] == (f"[checkpoint] {STEP2} is damaged ({run}/checkpoints/{STEP2}/{SHARD}: 1000 bytes, "
                        "7631589 when saved); passed over"), lines
    assert f"[checkpoint] resumed from {run}/checkpoints/{STEP1} (step 1)" in lines
    rolled = [x for x in lines if "per-step logs rolled back" in x]
    assert len(rolled) == 1 and "generations.jsonl" in rolled[0] and "failed_prompts.jsonl" in rolled[0]
    steps = [json.loads(x)["step"] for x in open(os.path.join(run, "metrics.jsonl"))]
    assert steps == [1, 2, 3]
    assert open(os.path.join(run, "generations.jsonl")).read() == gen0
    assert not os.path.exists(os.path.join(run, "failed_prompts.jsonl")) or \
        open(os.path.join(run, "failed_prompts.jsonl")).read() == ""
    assert open(os.path.join(run, "timeline", "rank0.jsonl")).read() == '{"name": "a"}\n'


LOAD_WIDE = """
import sys
from megarl.trainer import parallel
from megarl.checkpoint import CheckpointError, CheckpointManager
from megarl.config import load_config
from megarl.trainer.engine import Engine, EngineSpec
cfg = load_config(None, [f"model.hf_path={sys.argv[1]}", "model.init=random", "data.train_path=x"])
parallel.init_distributed()
ps = parallel.init_model_parallel(1, 1, seed=0)
try:
    CheckpointManager(cfg, ps, Engine.build(EngineSpec.from_config(cfg), ps)).load(sys.argv[2])
except CheckpointError as e:
    print("ERR", e)
"""


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """The tiny model with a twice wider MLP."""
    hf = str(tmp_path_factory.mktemp("wide") / "hf")
    shutil.copytree(os.path.join(REPO, "examples", "tiny", "hf"), hf)
    cfg = json.load(open(os.path.join(hf, "config.json")))
    cfg["intermediate_size"] *= 2
    json.dump(cfg, open(os.path.join(hf, "config.json"), "w"))
    return hf


def test_another_model_size_is_refused_at_preflight(saved, wide, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(saved, run)
    proc = train(run, 3, f"model.hf_path={wide}", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"megarl-train: checkpoint.save_dir: {run}/checkpoints/{STEP2} holds another model: tensor "
        f"decoder.layers.mlp.linear_fc1.weight has shape (4, 512, 128) there, (4, 1024, 128) for "
        f"model.hf_path={wide}"]
    assert sorted(os.listdir(run)) == sorted(os.listdir(saved))  # nothing written


def test_another_model_size_is_refused_by_the_load(saved, wide):
    """Where preflight did not run (a checkpoint loaded by path): the load compares every
    tensor's global shape with the checkpoint's before Megatron reads any."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", PYTHONPATH=REPO)
    ckpt = os.path.join(saved, "checkpoints", STEP2)
    proc = subprocess.run([sys.executable, "-c", LOAD_WIDE, wide, ckpt], capture_output=True, text=True,
                          env=env, timeout=300, cwd=REPO)
    errs = [x for x in proc.stdout.splitlines() if x.startswith("ERR ")]
    # (linear_fc1 is a swiglu factory, not a plain ShardedTensor: fc2 is the first one compared)
    assert errs == [f"ERR {ckpt}: tensor decoder.layers.mlp.linear_fc2.weight has shape (4, 128, 256) in "
                    "the checkpoint but (4, 128, 512) in this model (a checkpoint of another model "
                    "size?)"], proc.stdout[-2000:] + proc.stderr[-3000:]
