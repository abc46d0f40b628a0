"""Bad input to megarl-convert / megarl-logprobs: one line on stderr naming the file or key, exit
status 1, and nothing (not even a temp directory) left next to --out. Validation runs before any
rank starts, so these call the entry points in-process (inprocess_cli.call_main: the process left
as it was, and a call that gets past its refusal fails), plus one real subprocess; the calls that
start ranks run in one child process (the `ranked` fixture)."""
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from badinput_support import cli_env
from inprocess_cli import call_main, steps_in_a_child

from megarl.models.random_hf import tiny_config, write_random_hf
from megarl.commands import convert, logprobs


@pytest.fixture
def hf(tmp_path):
    return write_random_hf(str(tmp_path / "hf"), tiny_config("LlamaForCausalLM", num_hidden_layers=2))


def run(main, argv):
    """(exit status, stderr) of ``main(argv)`` in this process, as a child would run it."""
    res = call_main(main, [str(a) for a in argv], main.__module__, os.getcwd(), cli_env(), 300)
    assert not res.leaks, res.leaks
    return res.rc, res.stderr


def assert_fails(main, argv, *needles, out=None):
    return assert_one_line(*run(main, argv), *needles, out=out)


def assert_one_line(rc, err, *needles, out=None):
    assert rc == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(("megarl-convert: ", "megarl-logprobs: ")), err
    for n in needles:
        assert n in lines[0], lines[0]
    if out is not None:
        parent = os.path.dirname(out)
        assert not os.path.exists(out)
        assert not [n for n in os.listdir(parent) if n.startswith(".tmp-")]
    return lines[0]


def to_mcore(hf_dir, out, *extra):
    return [str(a) for a in ("hf-to-mcore", "--hf", hf_dir, "--out", out, *extra)]


def rewrite(hf_dir, drop=(), add=None, replace=None):
    path = os.path.join(hf_dir, "model.safetensors")
    t = load_file(path)
    for k in drop:
        del t[k]
    t.update(add or {})
    t.update(replace or {})
    save_file(t, path)


def edit_config(hf_dir, **changes):
    path = os.path.join(hf_dir, "config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump(cfg, open(path, "w"))


def test_missing_inputs(tmp_path, hf):
    out = str(tmp_path / "out")
    assert_fails(convert.main, to_mcore(tmp_path / "nope", out), "nope", "no such directory", out=out)
    os.remove(os.path.join(hf, "model.safetensors"))
    assert_fails(convert.main, to_mcore(hf, out), "no model.safetensors", out=out)
    os.remove(os.path.join(hf, "config.json"))
    assert_fails(convert.main, to_mcore(hf, out), "config.json", "not found", out=out)


def test_corrupt_and_truncated_safetensors(tmp_path, hf):
    out, path = str(tmp_path / "out"), os.path.join(hf, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    assert_fails(convert.main, to_mcore(hf, out), "model.safetensors", "cannot read", out=out)
    open(path, "wb").write(b"\x00not a safetensors file" * 4)
    assert_fails(convert.main, to_mcore(hf, out), "model.safetensors", "cannot read", out=out)


def test_sharded_index_naming_a_missing_file(tmp_path, hf):
    out = str(tmp_path / "out")
    t = load_file(os.path.join(hf, "model.safetensors"))
    json.dump({"weight_map": {k: "model-00001-of-00002.safetensors" for k in t}},
              open(os.path.join(hf, "model.safetensors.index.json"), "w"))
    assert_fails(convert.main, to_mcore(hf, out), "model-00001-of-00002.safetensors", out=out)


def test_shape_missing_unexpected_and_dtype(tmp_path, hf):
    out = str(tmp_path / "out")
    q = "model.layers.1.self_attn.q_proj.weight"
    rewrite(hf, replace={q: torch.zeros(32, 64)})
    assert_fails(convert.main, to_mcore(hf, out), q, "(32, 64)", "(64, 64)", out=out)
    rewrite(hf, replace={q: torch.zeros(64, 64)}, drop=["model.layers.0.mlp.up_proj.weight", "lm_head.weight"])
    assert_fails(convert.main, to_mcore(hf, out), "missing 2", "lm_head.weight",
                 "model.layers.0.mlp.up_proj.weight", out=out)
    rewrite(hf, add={"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 64),
                     "lm_head.weight": torch.zeros(128, 64), "model.extra.weight": torch.zeros(3)})
    assert_fails(convert.main, to_mcore(hf, out), "unexpected 1", "model.extra.weight", out=out)
    rewrite(hf, drop=["model.extra.weight"], replace={"model.norm.weight": torch.zeros(64, dtype=torch.int32)})
    assert_fails(convert.main, to_mcore(hf, out), "model.norm.weight", "I32", out=out)


def test_vocab_mismatch_unknown_architecture_and_bad_tp(tmp_path, hf):
    out = str(tmp_path / "out")
    edit_config(hf, vocab_size=130)
    assert_fails(convert.main, to_mcore(hf, out), "vocab size mismatch", "vocab_size=130",
                 "128 rows", out=out)
    edit_config(hf, vocab_size=128)
    assert_fails(convert.main, to_mcore(hf, out, "--tp", "3"), "--tp 3", "num_attention_heads=4",
                 out=out)
    assert_fails(convert.main, to_mcore(hf, out, "--pp", "3"), "--pp 3", "num_hidden_layers=2",
                 out=out)
    edit_config(hf, architectures=["GPT2LMHeadModel"])
    assert_fails(convert.main, to_mcore(hf, out), "GPT2LMHeadModel", "not supported", out=out)


Q = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def ranked(tmp_path_factory):
    """The calls that start ranks, made once in one child process (inprocess_cli.steps_in_a_child;
    in this process they left megarl's CUDA->CPU shim, a process group's environment and
    Megatron's warnings filters): a conversion with rope_parameters, a dist checkpoint with NaN
    weights (written with the HF-side check off) and the two tools refusing it as ranks read it.
    Returns (root, {key: (rc, stderr)})."""
    root = tmp_path_factory.mktemp("ranked")
    rope = write_random_hf(str(root / "rope"), tiny_config("LlamaForCausalLM", num_hidden_layers=2))
    edit_config(rope, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    nan = write_random_hf(str(root / "nan"), tiny_config("LlamaForCausalLM", num_hidden_layers=2))
    rewrite(nan, replace={Q: torch.full_like(load_file(os.path.join(nan, "model.safetensors"))[Q], float("nan"))})
    (root / "in.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    (root / "backs").mkdir()
    conv, lp = "megarl.commands.convert:main", "megarl.commands.logprobs:main"
    ckpt = str(root / "ckpt")
    steps = {"rope": (conv, to_mcore(rope, root / "rope_out", "--force"), []),
             "nan_ckpt": (conv, to_mcore(nan, ckpt), ["megarl.models.checks:check_finite_hf"]),
             "back": (conv, ["mcore-to-hf", "--ckpt", ckpt, "--out", str(root / "backs" / "back")], []),
             "lp": (lp, ["--ckpt", ckpt, "--input", str(root / "in.jsonl"), "--output", str(root / "lp.jsonl")], [])}
    return root, steps_in_a_child(steps, cli_env())


def test_rope_parameters_are_never_silently_ignored(tmp_path, hf, ranked):
    from megarl.protocol.hf_model import read_model_args

    edit_config(hf, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    if read_model_args(hf).rope_theta == 50000.0:  # the registry reads the newer layout
        rc, err = ranked[1]["rope"]  # accepted: the conversion started ranks (in the child)
        assert rc in (0, None) or "rope" not in err
    else:
        rc, err = run(convert.main, to_mcore(hf, tmp_path / "out", "--force"))
        assert rc == 1 and "rope_parameters" in err


def test_existing_output_and_dtype_choice(tmp_path, hf):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert_fails(convert.main, to_mcore(hf, out), "--force")
    assert (out / "keep.txt").read_text() == "x"
    rc, err = run(convert.main, to_mcore(hf, tmp_path / "o2", "--dtype", "int8"))  # argparse's SystemExit
    assert rc == 2 and "invalid choice" in err


def test_unwritable_output_is_refused_before_any_rank_starts(tmp_path, hf, monkeypatch):
    """An --output that is a directory, or an output in a directory that takes no new file (/sys:
    EACCES for root too), fails at validation: --tp 2 would relaunch under torchrun first."""
    from megarl.trainer import parallel

    monkeypatch.setattr(parallel, "relaunch", lambda *a: pytest.fail("ranks started before the output check"))
    inp, d = tmp_path / "in.jsonl", tmp_path / "adir"
    inp.write_text('{"input_ids": [1, 2, 3]}\n')
    d.mkdir()
    lp = ["--ckpt", hf, "--input", inp, "--tp", "2", "--output"]
    assert_fails(logprobs.main, lp + [d], f"--output {d}: is a directory")
    assert os.listdir(d) == [] and not os.path.exists(f"{d}.tmp")
    assert_fails(logprobs.main, lp + ["/sys/megarl-x.jsonl"], "--output /sys/megarl-x.jsonl",
                 "cannot write in /sys")
    assert_fails(convert.main, to_mcore(hf, "/sys/megarl-out", "--tp", "2"), "--out /sys/megarl-out",
                 "cannot write in /sys")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".megarl-probe-")]


def test_non_finite_weights_are_refused(tmp_path, hf, ranked):
    """A model whose weights are NaN (or hold an inf) passes every header check; the tools name
    the tensor and its file and write nothing. A dist checkpoint is checked as it is read: by
    ranks, so those two refusals are made in the `ranked` child."""
    out, inp = str(tmp_path / "out"), tmp_path / "in.jsonl"
    inp.write_text('{"input_ids": [1, 2, 3]}\n')
    q = Q
    t = load_file(os.path.join(hf, "model.safetensors"))[q]
    rewrite(hf, replace={q: torch.full_like(t, float("nan"))})
    st = os.path.join(hf, "model.safetensors")
    assert_fails(convert.main, to_mcore(hf, out), f"{st}: tensor {q} is all NaN", out=out)
    lp = ["--ckpt", hf, "--input", inp, "--output", tmp_path / "lp.jsonl"]
    assert_fails(logprobs.main, lp, f"{st}: tensor {q} is all NaN")
    assert not os.path.exists(tmp_path / "lp.jsonl")
    t[3, 5] = float("inf")
    rewrite(hf, replace={q: t})
    assert_fails(convert.main, to_mcore(hf, out), f"{st}: tensor {q} has 1 NaN/inf values of 4096",
                 out=out)
    # a dist checkpoint with NaN weights (written with the HF check off): refused as it is read
    root, res = ranked
    assert res["nan_ckpt"][0] == 0, res["nan_ckpt"][1][-3000:]
    ckpt, back = str(root / "ckpt"), str(root / "backs" / "back")
    assert_one_line(*res["back"], f"{ckpt} (decoder.layers.self_attention.linear_qkv.weight): tensor {q} is all NaN",
                    out=back)
    assert_one_line(*res["lp"], f"{ckpt}: tensor ", "NaN")
    assert not os.path.exists(root / "lp.jsonl") and not os.path.exists(root / "lp.jsonl.tmp")


def fake_checkpoint(path, hf_dir, shapes, complete=True, payload=None):
    """A checkpoint directory whose .metadata describes ``shapes`` (enough for validation)."""
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                       TensorProperties, TensorStorageMetadata)

    os.makedirs(path)
    entries = {k: TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(s),
                                        [ChunkStorageMetadata(torch.Size([0] * len(s)), torch.Size(s))])
               for k, s in shapes.items()}
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(payload if payload is not None else Metadata(state_dict_metadata=entries), f)
    open(os.path.join(path, "metadata.json"), "w").write('{"sharded_backend": "torch_dist"}')
    torch.save({}, os.path.join(path, "common.pt"))  # every Megatron dist-checkpoint has one
    if complete:
        json.dump({"complete": True, "kind": "converted"}, open(os.path.join(path, "megarl.json"), "w"))
    if hf_dir:
        os.link(os.path.join(hf_dir, "config.json"), os.path.join(path, "config.json"))


def test_mcore_to_hf_bad_checkpoints(tmp_path, hf):
    from megarl.protocol.hf_model import read_model_args
    from megarl.models.layouts import mcore_shapes

    out = str(tmp_path / "out")
    back = ["mcore-to-hf", "--out", out, "--ckpt"]
    assert_fails(convert.main, back + [tmp_path / "nope"], "nope", "no such directory", out=out)
    fake_checkpoint(str(tmp_path / "save" / ".tmp-step_00000004"), hf, {})  # a killed save only
    assert_fails(convert.main, back + [tmp_path / "save"], "save", "no complete step_*", out=out)
    shapes = mcore_shapes(read_model_args(hf))
    wrong = dict(shapes, **{"decoder.layers.mlp.linear_fc2.weight": (2, 64, 99)})
    fake_checkpoint(str(tmp_path / "c1"), hf, wrong)
    assert_fails(convert.main, back + [tmp_path / "c1"], "decoder.layers.mlp.linear_fc2.weight",
                 "(2, 64, 99)", "(2, 64, 128)", out=out)
    fake_checkpoint(str(tmp_path / "c2"), hf, {k: v for k, v in shapes.items() if k != "output_layer.weight"})
    assert_fails(convert.main, back + [tmp_path / "c2"], "missing 1", "output_layer.weight", out=out)
    fake_checkpoint(str(tmp_path / "c3"), None, shapes)
    assert_fails(convert.main, back + [tmp_path / "c3"], "no config.json", out=out)
    fake_checkpoint(str(tmp_path / "c4"), hf, shapes, payload={"evil": os.getcwd})
    assert_fails(convert.main, back + [tmp_path / "c4"], ".metadata", "not allowed", out=out)
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    md = Metadata(state_dict_metadata={"decoder.layers.mlp.linear_fc1._extra_state/shard_0_2":
                                       BytesStorageMetadata()})
    fake_checkpoint(str(tmp_path / "c5"), hf, shapes, payload=md)  # would be torch.load(weights_only=False)
    assert_fails(convert.main, back + [tmp_path / "c5"], "pickled objects", "_extra_state", out=out)


def test_logprobs_bad_input_lines(tmp_path, hf):
    inp, out = tmp_path / "in.jsonl", str(tmp_path / "out.jsonl")
    inp.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2\n')
    args = ["--ckpt", hf, "--input", inp, "--output", out]
    assert_fails(logprobs.main, args, "in.jsonl:2", "invalid JSON")
    inp.write_text('{"input_ids": [1, 999]}\n')
    assert_fails(logprobs.main, args, "in.jsonl:1", "token id 999", "[0, 128)")
    inp.write_text('{"ids": [1]}\n')
    assert_fails(logprobs.main, args, "in.jsonl:1", "input_ids")
    assert_fails(logprobs.main, ["--ckpt", tmp_path / "none", "--input", inp, "--output", out],
                 "no such directory")
    assert not os.path.exists(out)


def test_real_process_prints_one_line_and_no_traceback(tmp_path, hf):
    open(os.path.join(hf, "model.safetensors"), "wb").write(b"garbage")
    proc = subprocess.run([sys.executable, "-m", "megarl.commands.convert", "hf-to-mcore", "--hf", hf,
                           "--out", str(tmp_path / "out"), "--tp", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("megarl-convert: ") and "model.safetensors" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
