"""Bad-input corpus, class "damaged checkpoints": real checkpoints of the tiny SFT recipe (one
real `megarl-train` run, two checkpoints), copied and damaged one way each. `megarl-train`
resuming from a save dir in which no checkpoint is intact, or whose checkpoint holds a model of
another size, and `megarl-convert` / `megarl-logprobs` reading a damaged checkpoint: one line
naming the file (or the tensor and both shapes), non-zero exit, nothing written. (A damaged
newest checkpoint with an intact older one is not an error: tests/dist/test_checkpoint_damage.py
checks the fallback.)
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from badinput_support import REPO, TINY, CliCase, corpus_tests

from megarl.common.net import free_port

S1, S2, SHARD = "step_00000001", "step_00000002", "__0_0.distcp"
TRAIN = ("{sft_yaml}", "model.hf_path={hf}", "data.train_path={sft}", "train.run_dir={root}/runs/{id}",
         "train.global_batch_size=8", "train.steps=3", "checkpoint.hf_export_dir=")


def T(id, save, *needles, extra=()):  # noqa: N802 - a table row
    return CliCase(id, "megarl-train", TRAIN + (f"checkpoint.save_dir={{root}}/{save}",) + tuple(extra), 2,
                   ("checkpoint.save_dir: ",) + needles, ("{root}/runs/{id}",))


def C(id, ckpt, *needles):  # noqa: N802
    return CliCase(id, "megarl-convert", ("mcore-to-hf", "--ckpt", f"{{root}}/{ckpt}", "--out",
                                          "{root}/outs/{id}"), 1, needles,
                   ("{root}/outs/{id}", "{root}/outs/.tmp-{id}"))


def L(id, ckpt, *needles):  # noqa: N802
    return CliCase(id, "megarl-logprobs", ("--ckpt", f"{{root}}/{ckpt}", "--input", "{root}/lp.jsonl",
                                           "--output", "{root}/outs/{id}.jsonl"), 1, needles,
                   ("{root}/outs/{id}.jsonl", "{root}/outs/{id}.jsonl.tmp"))


CASES = {f"{c.prog}:{c.id}": c for c in [
    T("ckpt_none_intact_shard_truncated", "trunc", "no intact checkpoint in {root}/trunc: "
      "{root}/trunc/step_00000002/__0_0.distcp: 1000 bytes, 7631589 when saved",
      "(and 1 older one(s), also damaged)", "checkpoint.resume=false starts over"),
    T("ckpt_none_intact_shard_deleted", "deleted", "{root}/deleted/step_00000002/__0_0.distcp: missing"),
    T("ckpt_none_intact_common_missing", "common", "{root}/common/step_00000002/common.pt: missing"),
    T("ckpt_none_intact_index_missing", "index", "{root}/index/step_00000002/.metadata: missing"),
    T("ckpt_none_intact_rng_altered", "altered", "{root}/altered/step_00000002/rng/rank_00000.safetensors: "
      "contents changed since saved (CRC32 mismatch)"),
    T("ckpt_none_intact_common_pickle_refused", "pickled", "{root}/pickled/step_00000002/common.pt: refused by "
      "weights_only loading"),
    T("ckpt_latest_garbage_none_intact", "garbage", "{root}/garbage/step_00000002/common.pt: missing"),
    T("ckpt_other_model_size", "good", "{root}/good/step_00000002 holds another model: tensor "
      "decoder.layers.mlp.linear_fc1.weight has shape (4, 512, 128) there, (4, 1024, 128) for "
      "model.hf_path={root}/wide", extra=("model.hf_path={root}/wide",)),
    T("ckpt_other_model_depth", "good", "holds another model: tensor embedding.word_embeddings.weight",
      "(128, 128) there, (128, 64)", extra=("model.hf_path={root}/narrow",)),
    CliCase("ckpt_lora_switched_on", "megarl-train", TRAIN + ("checkpoint.save_dir={root}/good", "lora.rank=4"), 2,
            ("lora.rank: {root}/good/step_00000002 was trained with no LoRA, this config asks for LoRA rank 4 on "
             "linear_fc1, linear_fc2, linear_proj, linear_qkv; resume with the checkpoint's lora settings, or "
             "checkpoint.resume=false to start over",), ("{root}/runs/ckpt_lora_switched_on",)),
    CliCase("ckpt_lora_switched_off", "megarl-train", TRAIN + ("checkpoint.save_dir={root}/lora",), 2,
            ("lora.rank: {root}/lora/step_00000002 was trained with LoRA rank 4 on linear_proj, linear_qkv, "
             "this config asks for no LoRA",), ("{root}/runs/ckpt_lora_switched_off",)),
    C("ckpt_shard_truncated", "trunc/step_00000002", "{root}/trunc/step_00000002/__0_0.distcp: 1000 bytes"),
    C("ckpt_common_missing", "common/step_00000002", "{root}/common/step_00000002/common.pt: missing"),
    C("ckpt_save_dir_latest_damaged", "deleted", "{root}/deleted/step_00000002/__0_0.distcp: missing"),
    L("ckpt_shard_deleted", "deleted/step_00000002", "{root}/deleted/step_00000002/__0_0.distcp: missing"),
    L("ckpt_index_missing", "index/step_00000002", "{root}/index/step_00000002/.metadata: missing"),
    L("ckpt_shard_truncated_no_manifest", "nomanifest/step_00000002",
      "{root}/nomanifest/step_00000002/__0_0.distcp: truncated (1000 bytes, the index needs 7631589)"),
]}


def _both(save: str, fn) -> None:
    for step in (S1, S2):
        fn(os.path.join(save, step))


def _altered(d: str) -> None:
    """8 bytes of the RNG states inverted: still a valid file, with other values."""
    with open(os.path.join(d, "rng", "rank_00000.safetensors"), "r+b") as f:
        f.seek(-100, os.SEEK_END)
        data = f.read(8)
        f.seek(-100, os.SEEK_END)
        f.write(bytes(255 - b for b in data))


def _pickled_common(d: str) -> None:
    """common.pt replaced by a pickle of a plain object: refused before the manifest is read."""
    import datetime

    import torch

    torch.save({"x": datetime.date(2020, 1, 1)}, os.path.join(d, "common.pt"))


def _drop_manifest(d: str) -> None:
    meta = json.load(open(os.path.join(d, "megarl.json")))
    meta.pop("files")
    json.dump(meta, open(os.path.join(d, "megarl.json"), "w"))
    os.truncate(os.path.join(d, SHARD), 1000)


def _lora_meta(d: str) -> None:
    """megarl.json as a LoRA run writes it (the adapters' rank and targets): what the resume
    check reads, without a second training run."""
    path = os.path.join(d, "megarl.json")
    meta = json.load(open(path))
    meta["lora"] = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["linear_qkv", "linear_proj"]}
    json.dump(meta, open(path, "w"))


def _model_variant(src: str, dst: str, **changes) -> None:
    shutil.copytree(src, dst)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg.update(changes)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One real SFT run (checkpoints at steps 1 and 2), then save dirs damaged one way each."""
    root = str(tmp_path_factory.mktemp("badckpt"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()),
               PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-m", "megarl.train", f"{REPO}/configs/tiny_sft.yaml",
                           f"train.run_dir={root}/run", "train.steps=2", "train.global_batch_size=8",
                           "checkpoint.save_interval=1", "checkpoint.keep_last=5", "checkpoint.hf_export_dir="],
                          capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    damage = {"good": None, "trunc": lambda d: os.truncate(os.path.join(d, SHARD), 1000),
              "deleted": lambda d: os.remove(os.path.join(d, SHARD)),
              "common": lambda d: os.remove(os.path.join(d, "common.pt")),
              "index": lambda d: os.remove(os.path.join(d, ".metadata")), "altered": _altered,
              "garbage": lambda d: os.remove(os.path.join(d, "common.pt")), "nomanifest": _drop_manifest,
              "pickled": _pickled_common, "lora": _lora_meta}
    for name, fn in damage.items():
        save = os.path.join(root, name)
        shutil.copytree(os.path.join(root, "run", "checkpoints"), save)
        if fn is not None:
            _both(save, fn)
    open(os.path.join(root, "garbage", "latest"), "wb").write(b"\xff\xfe\x00junk")
    _model_variant(f"{TINY}/hf", os.path.join(root, "wide"), intermediate_size=512)
    _model_variant(f"{TINY}/hf", os.path.join(root, "narrow"), hidden_size=64, intermediate_size=256)
    open(os.path.join(root, "lp.jsonl"), "w").write('{"input_ids": [1, 4, 5]}\n')
    os.makedirs(os.path.join(root, "runs"))
    os.makedirs(os.path.join(root, "outs"))
    paths = {"root": root, "sft_yaml": f"{REPO}/configs/tiny_sft.yaml", "hf": f"{TINY}/hf",
             "sft": f"{TINY}/data/sft.jsonl"}
    return root, lambda text: text.format(**paths)


results, test_checkpoint_case, test_docs_list_every_case = corpus_tests(CASES)
