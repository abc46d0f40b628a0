"""Config loading: YAML + dotted overrides, and one-line errors that name the field."""
import os
import subprocess
import sys

import pytest
import yaml

from megarl.config import ConfigError, check_world_size, load_config, save_config
from megarl.models.checks import check_against_model
from megarl.models.random_hf import tiny_config, write_random_hf

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    # tiny Llama: 4 heads, 2 kv heads, 4 layers, vocab 128
    return write_random_hf(str(tmp_path_factory.mktemp("hf")), tiny_config())


def load(hf, *overrides):
    """load_config, then the checks against the model's config.json that preflight runs."""
    cfg = load_config(None, [f"model.hf_path={hf}", "data.train_path=x.jsonl", *overrides])
    check_against_model(cfg)
    return cfg


def test_yaml_and_overrides(tmp_path, hf):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"hf_path": hf}, "data": {"train_path": "t.jsonl"},
                                    "optim": {"lr": 1e-4}, "train": {"steps": 5}}))
    cfg = load_config(str(path), ["train.steps=7", "optim.lr=2e-4", "parallel.tp=2",
                                  "algo.eps_clip_high=0.28", "checkpoint.hf_export_dir="])
    assert cfg.train.steps == 7 and cfg.optim.lr == 2e-4 and cfg.parallel.tp == 2
    assert cfg.algo.eps_clip_high == 0.28 and cfg.checkpoint.hf_export_dir == ""
    out = save_config(cfg, str(tmp_path / "run"))
    again = load_config(out)
    assert again == cfg
    # numbers where strings are expected (argument lists, keys) are read as their text; bools are not
    cfg = load_config(str(path), ["rollout.server_args=[--max-running-requests,2,--x,0.5]",
                                  "rollout.api_key=1234"])
    assert cfg.rollout.server_args == ["--max-running-requests", "2", "--x", "0.5"]
    assert cfg.rollout.api_key == "1234"
    with pytest.raises(ConfigError, match=r"rollout.server_args\[0\]: expected a string, got True"):
        load_config(str(path), ["rollout.server_args=[true]"])


@pytest.mark.parametrize("override, field", [
    ("train.stepz=3", "train.stepz: unknown key"),
    ("bogus.x=1", "bogus: unknown key"),
    ("train.steps=abc", "train.steps: expected an integer"),
    ("train.steps=1.5", "train.steps: expected an integer"),
    ("optim.lr=fast", "optim.lr: expected a number"),
    ("parallel.distributed_optimizer=maybe", "parallel.distributed_optimizer: expected true/false"),
    ("optim.lr=-1", "optim.lr: must be > 0"),
    ("parallel.tp=3", "parallel.tp: 3 does not divide num_attention_heads=4"),
    ("parallel.tp=4", "parallel.tp: 4 does not divide num_key_value_heads=2"),
    ("parallel.pp=5", "parallel.pp: 5 is greater than num_hidden_layers=4"),
    ("parallel.tp=0", "parallel.tp: must be >= 1"),
    ("train.algorithm=dpo", "train.algorithm: must be one of"),
    ("algo.eps_clip_low=-0.1", "algo.eps_clip_low"),
    ("parallel.world_size=3", "parallel.world_size: 3 is not divisible by tp*pp*cp=2"),
    ("parallel.cp=0", "parallel.cp: must be >= 1"),
    ("parallel.cp_comm_type=ring", "parallel.cp_comm_type: must be one of p2p, all_gather, a2a, a2a+p2p"),
    ("parallel.vpp=2", "parallel.vpp: the interleaved schedule splits pipeline stages; needs parallel.pp >= 2"),
    ("parallel.vpp=1", "parallel.vpp: must be >= 2"),
    ("reward.model.path=rm", "reward.model.path: the job's reward-model servers are scored through "
                             "rollout.reward_fn=megarl.rewards.model:RewardModel"),
    ("reward.model.servers=0", "reward.model.servers: must be >= 1"),
    ("reward.model.health_interval_s=0", "reward.model.health_interval_s: must be > 0"),
    ("reward.model.port=1", "reward.model.port: unknown key"),
])
def test_bad_values_name_the_field(hf, override, field):
    extra = ["parallel.tp=2"] if override.startswith("parallel.world_size") else []
    with pytest.raises(ConfigError) as e:
        load(hf, *extra, override)
    msg = str(e.value)
    assert msg.startswith(field.split(":")[0]) and field in msg and "\n" not in msg


def test_world_size_not_divisible(hf):
    cfg = load(hf, "parallel.tp=2", "parallel.pp=2")
    assert check_world_size(cfg, 8) == 2
    with pytest.raises(ConfigError, match=r"^parallel.tp: world size 6 is not divisible by tp\*pp\*cp=4"):
        check_world_size(cfg, 6)
    cfg = load(hf, "parallel.tp=2", "parallel.cp=2")  # CP ranks count in the world: DP = 8 / (2 * 2)
    assert check_world_size(cfg, 8) == 2 and cfg.parallel.model_parallel == 4
    with pytest.raises(ConfigError, match=r"^parallel.tp: world size 6 is not divisible by tp\*pp\*cp=4 "
                                          r"\(tp=2, pp=1, cp=2\)$"):
        check_world_size(cfg, 6)


def test_context_parallel_refusals(hf):
    with pytest.raises(ConfigError, match=r"^train.micro_batch_tokens: 101 is odd; with parallel.cp=2 .* must be even$"):
        load(hf, "parallel.cp=2", "train.micro_batch_tokens=101")
    with pytest.raises(ConfigError, match="^parallel.cp: megatron-core's unfused attention has no context parallelism"):
        load(hf, "parallel.cp=2", "model.attention=unfused")
    assert load(hf, "parallel.cp=3", "train.micro_batch_tokens=100").parallel.cp == 3


def test_missing_model_dir(tmp_path):
    with pytest.raises(ConfigError, match="^model.hf_path: no config.json"):
        load(str(tmp_path))


def test_loading_reads_no_model_files(tmp_path):
    # a config is loaded and validated on its own: the model directory is preflight's to check
    cfg = load_config(None, [f"model.hf_path={tmp_path}/absent", "data.train_path=x.jsonl", "parallel.tp=3"])
    assert (cfg.model.hf_path, cfg.parallel.tp) == (f"{tmp_path}/absent", 3)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"hf_path": f"{tmp_path}/absent"}, "data": {"train_path": "x"}}))
    proc = subprocess.run([sys.executable, "-m", "megarl.train", str(path), f"train.run_dir={tmp_path}/run"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"megarl-train: model.hf_path: no config.json in '{tmp_path}/absent'"]


def test_cli_reports_one_line_and_nonzero_exit(hf, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"hf_path": hf}, "data": {"train_path": "x"}}))
    proc = subprocess.run([sys.executable, "-m", "megarl.train", str(cfg), "parallel.tp=3",
                           f"train.run_dir={tmp_path}/run"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "megarl-train: parallel.tp: 3 does not divide num_attention_heads=4"]
    assert not (tmp_path / "run").exists()
    missing = subprocess.run([sys.executable, "-m", "megarl.train", str(tmp_path / "nope.yaml")],
                             capture_output=True, text=True)
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"megarl-train: config: file not found: {tmp_path}/nope.yaml"


def test_uneven_pipeline_fields(hf):
    # 4 layers: any pp <= 4 is accepted (automatic split), explicit ends are checked like Megatron
    assert load(hf, "parallel.pp=3").parallel.first_stage_layers is None
    cfg = load(hf, "parallel.pp=2", "parallel.first_stage_layers=3")
    assert (cfg.parallel.first_stage_layers, cfg.parallel.last_stage_layers) == (3, None)
    for overrides, msg in [
        (["parallel.pp=2", "parallel.first_stage_layers=0"], "parallel.first_stage_layers: must be >= 1"),
        (["parallel.first_stage_layers=2"], "parallel.first_stage_layers: only with parallel.pp > 1"),
        (["parallel.pp=3", "parallel.last_stage_layers=1"],
         "parallel.last_stage_layers: the remaining 3 layers do not split evenly over the other 2"),
        (["parallel.pp=2", "parallel.first_stage_layers=1", "parallel.last_stage_layers=1"],
         "parallel.first_stage_layers: first + last = 2 must equal num_hidden_layers=4"),
        (["model.make_vocab_size_divisible_by=0"], "model.make_vocab_size_divisible_by: must be >= 1"),
    ]:
        with pytest.raises(ConfigError) as e:
            load(hf, *overrides)
        assert str(e.value).startswith(msg) and "\n" not in str(e.value)


def test_moe_parallel_fields(tmp_path, hf):
    moe = write_random_hf(str(tmp_path / "moe"), tiny_config("Qwen3MoeForCausalLM"))
    assert load(moe, "parallel.ep=2").parallel.ep == 2
    assert load(moe, "train.algorithm=grpo", "rollout.servers=[http://sglang:30000]").rollout.servers
    assert not load(moe, "train.algorithm=grpo").rollout.servers  # the local CPU server serves MoE
    # TP > 1 with MoE: accepted with sequence parallelism on the TE spec (built on GPUs only)
    assert load(moe, "model.spec=te", "parallel.tp=2", "parallel.sequence_parallel=true").parallel.tp == 2
    # the local CPU rollout server serves Qwen3-MoE: RL with local servers loads
    assert load(moe, "train.algorithm=grpo", "rollout.local_servers=1").rollout.local_servers == 1
    for model, overrides, msg in [
        (moe, ["parallel.tp=2"], "parallel.tp: MoE models (Qwen3MoeForCausalLM) with tp=2 > 1 need "
                                 "parallel.sequence_parallel=true with the TE spec (model.spec=te, GPU)"),
        (moe, ["parallel.ep=3"], "parallel.ep: 3 does not divide num_experts=4"),
        (hf, ["parallel.ep=2"], "parallel.ep: 2 > 1 needs an MoE model"),
        (moe, ["moe.routing_replay=rollout", "model.recompute=true", "parallel.pp=2"],
         "moe.routing_replay: not supported with model.recompute and parallel.pp > 1"),
        (moe, ["moe.routing_replay=rollout", "moe.replay_check=true", "algo.prox_logp_mode=loglinear",
               "algo.policy_loss=decoupled_ppo"], "moe.replay_check: needs algo.prox_logp_mode recompute"),
        (moe, ["moe.replay_check=true"], "moe.replay_check: needs moe.routing_replay: rollout"),
        (moe, ["moe.aux_loss_coeff=-0.1"], "moe.aux_loss_coeff: must be >= 0 and <= 1"),
        (moe, ["moe.z_loss_coeff=2"], "moe.z_loss_coeff: must be >= 0 and <= 1"),
    ]:
        with pytest.raises(ConfigError) as e:
            load(model, *overrides)
        assert str(e.value).startswith(msg)
    with pytest.raises(ConfigError, match="^parallel.ep: 2 does not divide the data-parallel size 3"):
        check_world_size(load(moe, "parallel.ep=2"), 3)


def test_duplicate_yaml_key_is_refused(tmp_path, hf):
    path = tmp_path / "dup.yaml"
    path.write_text(f"model:\n  hf_path: {hf}\ndata:\n  train_path: x\ntrain:\n  steps: 3\n"
                    "train:\n  algorithm: rl\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert str(e.value) == f"config: {path}: duplicate key 'train' at line 7 (first at line 5)"
    path.write_text(f"model:\n  hf_path: {hf}\n  hf_path: other\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'hf_path' at line 3 \(first at line 2\)$"):
        load_config(str(path))
    with pytest.raises(ConfigError, match=r"^override 'train=\{steps: 3, steps: 4\}': duplicate key 'steps'"):
        load(hf, "train={steps: 3, steps: 4}")


def test_whole_section_override_merges_field_by_field(tmp_path, hf):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"hf_path": hf}, "data": {"train_path": "t.jsonl"},
                                    "train": {"algorithm": "rl", "steps": 9, "global_batch_size": 16},
                                    "rollout": {"workflow_args": {"max_turns": 4, "tools": ["calculator"]}}}))
    cfg = load_config(str(path), ["train={steps: 3, seed: 7}", "rollout.workflow_args={max_turns: 2}"])
    # the recipe's other train fields stay; a mapping-valued field is replaced whole
    assert (cfg.train.algorithm, cfg.train.steps, cfg.train.seed, cfg.train.global_batch_size) == ("rl", 3, 7, 16)
    assert cfg.rollout.workflow_args == {"max_turns": 2}
    with pytest.raises(ConfigError, match=r"^train\.stepz: unknown key"):
        load_config(str(path), ["train={stepz: 3}"])
    with pytest.raises(ConfigError, match=r"^train: expected a mapping, got 3"):
        load_config(str(path), ["train=3"])
    # the scalar is blamed on the override that gave it, not on the next one that needs the section
    for overrides in (["train=5", "train.steps=3"], ["train=5", "optim.lr=1e-4", "train={steps: 3}"]):
        with pytest.raises(ConfigError, match=r"^train: expected a mapping, got 5 \(a section: train\.field=value"):
            load_config(str(path), overrides)


def test_staleness_threshold_alone_and_precedence(tmp_path, hf):
    rl = ["train.algorithm=rl", "train.global_batch_size=16"]
    cfg = load(hf, *rl, "rollout.staleness_threshold=0.5")  # the default max_staleness=1 yields
    assert (cfg.rollout.max_staleness, cfg.rollout.staleness_threshold, cfg.rollout.staleness) == (0, 0.5, 0.5)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"hf_path": hf}, "data": {"train_path": "t"},
                                    "rollout": {"max_staleness": 2}}))
    cfg = load_config(str(path), ["rollout.staleness_threshold=0.25"])  # command line over recipe
    assert (cfg.rollout.max_staleness, cfg.rollout.staleness) == (0, 0.25)
    path.write_text(yaml.safe_dump({"model": {"hf_path": hf}, "data": {"train_path": "t"},
                                    "rollout": {"staleness_threshold": 0.25}}))
    cfg = load_config(str(path), ["rollout.max_staleness=3"])
    assert (cfg.rollout.staleness_threshold, cfg.rollout.staleness) == (0.0, 3.0)
    assert load_config(str(path)).rollout.staleness == 0.25  # recipe over default
    again = load_config(save_config(load_config(str(path)), str(tmp_path / "run")))
    assert (again.rollout.max_staleness, again.rollout.staleness_threshold) == (0, 0.25)
    with pytest.raises(ConfigError, match=r"^rollout.staleness_threshold: set either it .* \(got 0.5 and 2\)"):
        load(hf, "rollout.staleness_threshold=0.5", "rollout.max_staleness=2")


@pytest.mark.parametrize("overrides, message", [
    (["rollout.group_size=1", "train.global_batch_size=8"],
     "rollout.group_size: 1 with algo.advantage=grpo (a group-relative baseline) gives every sample advantage 0"),
    (["rollout.group_size=1", "train.global_batch_size=8", "algo.advantage=rloo"],
     "rollout.group_size: 1 with algo.advantage=rloo"),
    (["rollout.group_size=1", "train.global_batch_size=8", "algo.advantage=reinforce_pp",
      "algo.dynamic_sampling=true"], "algo.dynamic_sampling: drops groups whose rewards are all equal"),
    (["rollout.temperature=0"], "rollout.temperature: must be > 0, got 0.0 (temperature 0 samples every"),
])
def test_settings_that_cannot_learn_are_refused(hf, overrides, message):
    with pytest.raises(ConfigError) as e:
        load(hf, "train.algorithm=rl", *overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    # a group of one is fine where the baseline is not the group's (and for SFT)
    assert load(hf, "train.algorithm=rl", "rollout.group_size=1", "train.global_batch_size=8",
                "algo.advantage=reinforce_pp").rollout.group_size == 1
    assert load(hf, "rollout.group_size=1").rollout.group_size == 1


def test_outputs_resolve_under_the_run_dir(tmp_path, hf):
    run = tmp_path / "runs" / "b"
    cfg = load(hf, f"train.run_dir={run}", "checkpoint.hf_export_dir=model", "checkpoint.save_dir=ck",
               "weights.disk_dir=w")
    assert cfg.checkpoint.hf_export_dir == str(run / "model") and cfg.checkpoint.save_dir == str(run / "ck")
    assert cfg.weights.disk_dir == str(run / "w")
    assert load_config(save_config(cfg, str(run))) == cfg  # resolved once: absolute in config.yaml
    # the recipes export to <run_dir>/model: another run_dir moves the export with it
    demo = load_config(os.path.join(REPO, "configs", "tiny_grpo.yaml"), [f"model.hf_path={hf}", f"train.run_dir={tmp_path}/x"])
    assert demo.checkpoint.hf_export_dir == f"{tmp_path}/x/model"


def test_output_inside_another_run_is_refused(tmp_path, hf):
    other = tmp_path / "runs" / "a"
    save_config(load(hf, f"train.run_dir={other}"), str(other))  # run a exists
    mine = f"train.run_dir={tmp_path}/runs/b"
    for override in (f"checkpoint.hf_export_dir={other}/model", f"checkpoint.save_dir={other}/ck",
                     f"checkpoint.hf_export_dir={other}/exports/step_{{step}}"):
        with pytest.raises(ConfigError) as e:
            load(hf, mine, override)
        field = override.split("=")[0]
        assert str(e.value).startswith(f"{field}: {other}/") and f"inside the directory of another run ({other})" \
            in str(e.value)
    with pytest.raises(ConfigError, match=r"^checkpoint.hf_export_dir: .* is or contains train.run_dir"):
        load(hf, mine, f"checkpoint.hf_export_dir={tmp_path}/runs")
    # its own outputs, and a resume of run a, are fine
    assert load(hf, f"train.run_dir={other}", f"checkpoint.hf_export_dir={other}/model").checkpoint.hf_export_dir
    assert load(hf, mine, f"checkpoint.hf_export_dir={tmp_path}/exports/b").checkpoint.hf_export_dir


def test_weights_disk_delta_choices():
    base = ["data.train_path=x", "model.hf_path=x", "weights.transport=disk"]
    assert load_config(None, base).weights.disk_delta == "off"
    assert load_config(None, base + ["weights.disk_delta=xor"]).weights.disk_delta == "xor"
    with pytest.raises(ConfigError, match=r"^weights.disk_delta: must be one of off, raw, xor; got 'zstd'$"):
        load_config(None, base + ["weights.disk_delta=zstd"])
    with pytest.raises(ConfigError, match=r"^weights.disk_delta: real SGLang"):
        load_config(None, base + ["weights.disk_delta=raw", "weights.tensor_format=sglang",
                                  "weights.verify_interval=0"])


def test_reward_model_section(hf, tmp_path):
    """reward.model: a nested section, set in a recipe or field by field; the reward must be
    RewardModel and must not name its own URLs; preflight refuses a path that is no reward model."""
    from megarl.launch.preflight import check_plugins

    rm = ["rollout.reward_fn=megarl.rewards.model:RewardModel"]
    cfg = load(hf, *rm, "reward.model.path=/x", "reward.model.servers=2")
    assert (cfg.reward.model.path, cfg.reward.model.servers, cfg.reward.model.threads) == ("/x", 2, 1)
    cfg = load(hf, *rm, "reward.model={path: /y, threads: 3}")
    assert (cfg.reward.model.path, cfg.reward.model.threads) == ("/y", 3)
    with pytest.raises(ConfigError, match=r"^reward.args.urls: the job serves reward.model.path"):
        load(hf, *rm, "reward.model.path=/x", "reward.args={urls: [http://127.0.0.1:1]}")
    for path, why in ((str(tmp_path / "none"), "is not a directory"), (hf, "not a reward model")):
        cfg = load(hf, *rm, f"reward.model.path={path}")
        with pytest.raises(ConfigError, match=f"^reward.model.path: .*{why}"):
            check_plugins(cfg)
    # the shipped tiny reward model passes; its URLs are not needed to check RewardModel's arguments
    check_plugins(load(hf, *rm, f"reward.model.path={REPO}/examples/tiny/reward_model"))
    with pytest.raises(ConfigError, match=r"^rollout.reward_fn: .*cannot be built from reward.args"):
        check_plugins(load(hf, *rm, "reward.args={nope: 1}", f"reward.model.path={REPO}/examples/tiny/reward_model"))
    with pytest.raises(ConfigError, match=r"^rollout.eval_reward_fn: "):
        check_plugins(load(hf, "rollout.eval_reward_fn=megarl.rewards:no_such_fn"))

