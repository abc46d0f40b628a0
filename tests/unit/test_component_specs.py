"""Components are built from their own sections (`EngineSpec`, `CriticSpec`, `PushSpec`), and the
pusher's collaborators are declared protocols (`Transport`, `PushTarget`), not isinstance checks."""
from __future__ import annotations

import dataclasses

import pytest

from megarl.config import (CriticConfig, ModelConfig, OptimConfig, ParallelConfig, WeightSyncConfig,
                           load_config)
from megarl.config.moe import MoEConfig
from megarl.rollout.admin import AdminRunner
from megarl.rollout.cluster import RolloutCluster
from megarl.weights.target import PushTarget
from megarl.trainer.critic import CriticSpec
from megarl.trainer.engine import EngineSpec
from megarl.trainer.rollout_link import ManagerCluster
from megarl.protocol.wire_plan import WirePlan
from megarl.weights.push import PushSpec
from megarl.weights.disk_delta import DiskDeltaTransport
from megarl.weights.shard_push import ShardRefitTransport
from megarl.weights.transports import DiskTransport, DistributedTransport, TensorTransport, Transport


def test_engine_spec_without_a_config():
    spec = EngineSpec(ModelConfig(hf_path="/m"), ParallelConfig(), OptimConfig(lr=0.5), MoEConfig(),
                      steps=7, micro_batch_tokens=64)
    assert (spec.model.hf_path, spec.optim.lr, spec.steps, spec.micro_batch_tokens) == ("/m", 0.5, 7, 64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.steps = 8


def _cfg(*overrides):
    return load_config(None, list(overrides), validate=False)


def test_engine_spec_from_config_reads_its_sections():
    cfg = _cfg("train.steps=11", "train.micro_batch_tokens=96", "data.tokenizer_path=/tok", "optim.lr=0.25")
    spec = EngineSpec.from_config(cfg)
    assert spec.model is cfg.model and spec.parallel is cfg.parallel and spec.moe is cfg.moe
    assert (spec.steps, spec.micro_batch_tokens, spec.tokenizer_path, spec.optim.lr) == (11, 96, "/tok", 0.25)


def test_critic_spec_builds_its_engine_from_its_own_sections():
    cfg = _cfg("model.hf_path=/actor", "critic.hf_path=/critic", "critic.lr=0.01", "optim.lr=0.001",
               "optim.min_lr=0.0005", "train.ppo_epochs=3", "train.seed=5", "critic.warmup_steps=2")
    spec = CriticSpec.from_config(cfg)
    assert spec.engine.model.hf_path == "/critic" and cfg.model.hf_path == "/actor"  # the actor's untouched
    assert (spec.engine.optim.lr, spec.engine.optim.min_lr) == (0.01, 0.0005)
    assert (cfg.optim.lr, spec.ppo_epochs, spec.seed, spec.critic.warmup_steps) == (0.001, 3, 5, 2)
    same = CriticSpec.from_config(_cfg("model.hf_path=/actor", "optim.lr=0.001", "optim.min_lr=0.0005"))
    assert (same.engine.model.hf_path, same.engine.optim.lr, same.engine.optim.min_lr) == ("/actor", 0.001, 0.0005)
    # built without a Config as well
    direct = CriticSpec(CriticConfig(value_clip=0.2), spec.engine, spec.algo, 4, 1, 0)
    assert direct.critic.value_clip == 0.2 and direct.ppo_mini_batch_size == 4


def test_push_spec():
    wire = WirePlan(tensor_format="megarl", pause_mode="abort", verify_every=10, overlap=True)
    spec = PushSpec(WeightSyncConfig(bucket_mb=3), "/run", wire)
    assert (spec.weights.bucket_mb, spec.run_dir, spec.wire.overlap, spec.wire.streams_buckets) == (3, "/run", True, True)
    resolved = ["weights.tensor_format=megarl", "weights.pause_mode=abort", "weights.verify_interval=10"]
    assert PushSpec.from_config(_cfg("train.run_dir=/r", "weights.bucket_mb=9", "rollout.max_staleness=1",
                                     *resolved)) == PushSpec(
        dataclasses.replace(WeightSyncConfig(), bucket_mb=9, tensor_format="megarl", pause_mode="abort",
                            verify_interval=10), "/r", wire)
    # the spec's decisions are its wire plan's (tests/unit/test_wire_plan.py has the whole table)
    assert not PushSpec.from_config(_cfg("rollout.max_staleness=0", *resolved)).wire.overlap
    with pytest.raises(ValueError, match="^weights.tensor_format: auto was not resolved"):
        PushSpec.from_config(_cfg())


@pytest.mark.parametrize("fields,cls", [
    ({"transport": "distributed"}, DistributedTransport), ({"transport": "tensor"}, TensorTransport),
    ({"transport": "disk"}, DiskTransport), ({"transport": "disk", "disk_delta": "xor"}, DiskDeltaTransport),
    ({"transport": "distributed", "refit": "shard"}, ShardRefitTransport)])
def test_push_spec_knows_whether_its_transport_streams(fields, cls):
    """The pusher decides delta pushes and stage sources' own admin links before it builds the
    transport: the plan's answer is the class's the pusher then builds (`WeightPusher._connect`)."""
    w = WeightSyncConfig(tensor_format="megarl", pause_mode="abort", verify_interval=0, **fields)
    assert PushSpec(w, "/r", WirePlan.decide(w)).wire.streams_buckets is cls.streams_buckets


def _members(proto) -> set[str]:
    own = {n for n in vars(proto) if not n.startswith("_")} - {"streams_buckets"}
    return own | set(getattr(proto, "__annotations__", {}))


@pytest.mark.parametrize("cls,streams", [(DistributedTransport, True), (TensorTransport, True),
                                         (DiskTransport, False), (DiskDeltaTransport, False)])
def test_transports_declare_the_protocol(cls, streams):
    assert _members(Transport) == {"setup", "send", "finish", "close", "streams_buckets"}
    assert all(callable(getattr(cls, m)) for m in _members(Transport) - {"streams_buckets"})
    assert cls.streams_buckets is streams


def test_both_clusters_are_push_targets():
    want = _members(PushTarget)
    assert {"stage_admin", "pause_for_update", "end_push", "commit", "addresses", "driver", "admin",
            "version"} <= want
    local = RolloutCluster(["127.0.0.1:1"], driver=False, api_key="k", timeout_s=7.0)
    remote = ManagerCluster(["127.0.0.1:1"], link=None, manager_address="127.0.0.1:2")
    for c in (local, remote):
        missing = [m for m in want if not hasattr(c, m)]
        assert missing == [], (type(c).__name__, missing)
    admin = local.stage_admin(1)  # the stage source's own connection, with the cluster's key and deadline
    try:
        assert isinstance(admin, AdminRunner) and admin.addresses == local.addresses
    finally:
        admin.close()


# ---------------------------------------------------------------- the rollout side: controller, eval, manager
def _task_files(tmp_path):
    """A tokenizer directory and a three-prompt jsonl file (the task a rollout spec names)."""
    import json

    from chatml import write_chat_tokenizer

    write_chat_tokenizer(str(tmp_path / "tok"))
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(3)))
    return str(tmp_path / "tok"), str(data)


def test_controller_and_eval_built_from_their_sections_without_a_config(tmp_path):
    from megarl.config import DataConfig, RewardConfig, RolloutConfig
    from megarl.rollout.setup import ControllerSpec, EvalSpec, TaskSpec, build_controller, build_eval

    tok, data = _task_files(tmp_path)
    rollout = RolloutConfig(group_size=2, max_staleness=3, max_concurrent=5, temperature=0.7, max_new_tokens=9,
                            max_retries=4, seed=11, eval_k=2, eval_size=2)
    task = TaskSpec(rollout, DataConfig(train_path=data, eval_path=data, shuffle=False), RewardConfig(), tok, 256)
    spec = ControllerSpec(task, batch_groups=6, seed=3, dynamic_sampling=True, hold_timeout_s=42.0,
                          failed_log=str(tmp_path / "failed.jsonl"), routes=(4, 2))
    c = build_controller(spec, RolloutCluster([], driver=False))
    assert (c.staleness.batch_size, c.staleness.max_staleness, c.staleness.max_concurrent) == (6, 3, 5)
    assert (c.dynamic_sampling, c.hold_timeout_s, c.max_retries, c.sampling_seed) == (True, 42.0, 4, 11)
    assert c.failed_log == str(tmp_path / "failed.jsonl") and c._client_kwargs == {"routed_experts": (4, 2), "lora_adapters": False}
    assert [s.answer for s in c.dataset] == ["0", "1", "2"] and c.sampler.next_batch(3) == [0, 1, 2]
    wf = c.workflow
    assert (wf.ctx.group_size, wf.ctx.max_seq_len, wf.ctx.sampling.temperature,
            wf.ctx.sampling.max_new_tokens) == (2, 256, 0.7, 9)

    ev = build_eval(EvalSpec(task, dump_path=str(tmp_path / "gen.jsonl")), c.reward)
    assert ev.workflows.greedy.ctx.sampling.temperature == 0.0 and ev.workflows.sampled.group_size == 2
    assert len(ev.samples) == 2 and ev.dump_path == str(tmp_path / "gen.jsonl")
    no_eval = TaskSpec(rollout, DataConfig(train_path=data), RewardConfig(), tok, 256)
    assert build_eval(EvalSpec(no_eval), c.reward) is None  # data.eval_path empty: no evaluation


def test_rollout_specs_from_config_read_their_sections(tmp_path):
    from megarl.rollout.manager import ManagerSpec
    from megarl.rollout.setup import ControllerSpec, EvalSpec, TaskSpec

    cfg = _cfg("model.hf_path=/m", "data.tokenizer_path=/tok", "train.max_seq_len=300", "train.run_dir=/run",
               "train.global_batch_size=8", "rollout.group_size=2", "train.trigger_parameter_sync_step=3",
               "train.seed=9", "weights.timeout_s=77", "algo.dynamic_sampling=true", "logging.timeline=true",
               "logging.dump_eval_generations=true", "weights.disk_dir=/d", "weights.tensor_format=megarl",
               "weights.pause_mode=retract", "weights.verify_interval=0")
    task = TaskSpec.from_config(cfg)
    assert task == TaskSpec(cfg.rollout, cfg.data, cfg.reward, "/tok", 300)
    assert TaskSpec.from_config(_cfg("model.hf_path=/m")).tokenizer_path == "/m"  # the model's tokenizer
    c = ControllerSpec.from_config(cfg)
    # the staleness clock ticks once per push: 4 groups a step x 3 steps a push
    assert (c.batch_groups, c.seed, c.dynamic_sampling, c.hold_timeout_s) == (12, 9, True, 77.0)
    assert (c.failed_log, c.routes, c.task) == ("/run/failed_prompts.jsonl", None, task)
    assert EvalSpec.from_config(cfg) == EvalSpec(task, "/run/eval_generations.jsonl", last_step=cfg.train.steps)
    assert EvalSpec.from_config(_cfg("model.hf_path=/m")).dump_path is None
    m = ManagerSpec.from_config(cfg)
    assert (m.model_path, m.run_dir, m.timeline, m.server_flags, m.weights.disk_dir) == ("/m", "/run", True, (), "/d")
    assert m.controller == c and m.eval == EvalSpec.from_config(cfg) and m.rollout is cfg.rollout
    assert m.wire == WirePlan.of_config(cfg) and m.wire.pause_mode == "retract"  # no /run/wire.json: decided


def test_manager_built_from_its_spec_without_a_config(tmp_path):
    """The manager on external servers: its cluster takes the key, deadline and pause mode of its
    sections, the staleness clock continues from the trainer's version, the controller is its spec's."""
    from megarl.config import DataConfig, RewardConfig, RolloutConfig
    from megarl.protocol.messages import Init
    from megarl.rollout.manager import ManagerSpec, RolloutManager
    from megarl.rollout.setup import ControllerSpec, EvalSpec, TaskSpec

    tok, data = _task_files(tmp_path)
    rollout = RolloutConfig(servers=["127.0.0.1:9"], api_key="k", group_size=2)
    weights = WeightSyncConfig(timeout_s=13.0, pause_mode="retract")
    task = TaskSpec(rollout, DataConfig(train_path=data), RewardConfig(), tok, 128)
    spec = ManagerSpec(rollout, weights, "/unused-model", str(tmp_path / "run"),
                       ControllerSpec(task, batch_groups=2, seed=0), EvalSpec(task))
    m = RolloutManager(spec)
    try:
        assert m.init(Init(dp=2, version=5)) == ["http://127.0.0.1:9"]
        assert m.local is None  # rollout.servers given: no local server processes
        cl = m.cluster
        assert (cl.version, cl.api_key, cl.timeout_s, cl.pause_mode, m.dp) == (5, "k", 13.0, "retract", 2)
        assert m.controller.staleness.batch_size == 2 and len(m.controller.dataset) == 3
    finally:
        m.close()


def test_eval_report_crosses_the_channel_as_its_own_reply():
    from megarl.protocol.channel import decode, encode
    from megarl.protocol.messages import DIRECT_REPLIES, EvalReport

    frame = b"".join(encode(EvalReport(metrics={"eval/accuracy": 0.5}, running=2)))
    back = decode(frame[4:], [])
    assert back == EvalReport({"eval/accuracy": 0.5}, 2)
    assert EvalReport in DIRECT_REPLIES
