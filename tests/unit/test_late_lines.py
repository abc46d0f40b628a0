"""Inputs refused at preflight, before any rank or server starts, that used to fail only after
ranks and servers had started (issue 40, "late lines"): each is one line naming the field.
In-process through `megarl.launch.preflight.check_model` (what megarl-train runs first)."""
from __future__ import annotations

import os

import pytest

from megarl.common.errors import ConfigError
from megarl.config import load_config
from megarl.launch.preflight import check_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY, MOE = f"{REPO}/examples/tiny/model", f"{REPO}/examples/tiny_moe/model"


@pytest.mark.parametrize("overrides,line", [
    (["lora.rank=1000000000"], "lora.rank: 1000000000 is above the model's hidden size 128 "),
    (["lora.rank=9223372036854775808"], "lora.rank: 9223372036854775808 is above the model's hidden size 128 "),
    ([f"model.hf_path={MOE}", "train.pack_sequences=true"], "train.pack_sequences: not supported for MoE models "),
    ([f"model.hf_path={MOE}", "parallel.pp=2", "parallel.vpp=2", "train.global_batch_size=16"],
     "parallel.vpp: the interleaved schedule needs packed sequences, which MoE models do not run "),
    ([f"model.hf_path={MOE}", "parallel.cp=2"], "parallel.cp: context parallelism is not supported for MoE models "
                                                "(Qwen3MoeForCausalLM has "),
    ([f"model.hf_path={MOE}", "lora.rank=8"],
     "lora.target_modules: MoE expert layers (linear_fc1/linear_fc2 of Qwen3MoeForCausalLM) are not supported"),
])
def test_refused_at_preflight_in_one_line(overrides, line):
    cfg = load_config(os.path.join(REPO, "configs", "tiny_grpo.yaml"), [f"model.hf_path={TINY}", *overrides])
    with pytest.raises(ConfigError) as e:
        check_model(cfg)
    assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)


def test_the_same_models_pass_without_those_settings():
    for model, extra in ((TINY, ["lora.rank=8"]), (MOE, ["lora.rank=8", "lora.target_modules=[linear_qkv]"])):
        check_model(load_config(os.path.join(REPO, "configs", "tiny_grpo.yaml"), [f"model.hf_path={model}", *extra]))


def test_architectures_given_as_a_string_is_named_as_such(tmp_path):
    import json
    import shutil

    from megarl.protocol.hf_model import read_model_args

    model = tmp_path / "model"
    shutil.copytree(TINY, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = cfg["architectures"][0]
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'architectures' must be a list of class names, e\.g\. \[\"LlamaForCausalLM\"\]; "
                                         r"got str 'LlamaForCausalLM'"):
        read_model_args(str(model))


@pytest.mark.parametrize("args,line", [
    ("[--no-such-flag]", "rollout.server_args: --no-such-flag: megarl-server: unrecognized arguments: --no-such-flag"),
    ("[--max-running-requests,lots]",
     "rollout.server_args: --max-running-requests lots: megarl-server: argument --max-running-requests: invalid int value: 'lots'"),
    ("[--threads,0]", "rollout.server_args: --threads 0: megarl-server: --threads: out of range: 0"),
])
def test_junk_server_args_are_refused_by_the_servers_own_parser(args, line):
    """megarl-server's parser, in-process (SGLang's runs in its venv: tests/e2e/test_sglang_train.py)."""
    from megarl.launch.preflight import check_server_args

    cfg = load_config(os.path.join(REPO, "configs", "tiny_grpo.yaml"), [f"model.hf_path={TINY}",
                                                                       f"rollout.server_args={args}"])
    with pytest.raises(ConfigError) as e:
        check_server_args(cfg)
    assert str(e.value) == line
    check_server_args(load_config(os.path.join(REPO, "configs", "tiny_grpo.yaml"),
                                  [f"model.hf_path={TINY}", "rollout.server_args=[--max-running-requests,1]"]))


def test_colocated_sglang_without_cuda_is_refused_before_anything_starts(monkeypatch):
    from megarl.launch import preflight
    from megarl.rollout import sglang_local

    monkeypatch.setattr(sglang_local, "cuda_available", lambda: False)
    cfg = load_config(os.path.join(REPO, "configs", "tiny_grpo.yaml"),
                      [f"model.hf_path={TINY}", "rollout.engine=sglang", "rollout.placement=colocated",
                       "rollout.max_staleness=0"])
    with pytest.raises(ConfigError, match=r"^rollout.placement: colocated with rollout.engine=sglang needs CUDA"):
        preflight.check_inputs(cfg)
