"""Components are built from their own sections (`EngineSpec`, `CriticSpec`, `PushSpec`), and the
pusher's collaborators are declared protocols (`Transport`, `PushTarget`), not isinstance checks."""
from __future__ import annotations

import dataclasses

import pytest

from megarl.config import (CriticConfig, ModelConfig, OptimConfig, ParallelConfig, WeightSyncConfig,
                           load_config)
from megarl.models.moe_config import MoEConfig
from megarl.rollout.admin import AdminRunner
from megarl.rollout.cluster import PushTarget, RolloutCluster
from megarl.trainer.critic import CriticSpec
from megarl.trainer.engine import EngineSpec
from megarl.trainer.rollout_link import ManagerCluster
from megarl.weights.push import PushSpec
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
    spec = PushSpec(WeightSyncConfig(bucket_mb=3), "/run")
    assert (spec.weights.bucket_mb, spec.run_dir) == (3, "/run")
    assert PushSpec.from_config(_cfg("train.run_dir=/r", "weights.bucket_mb=9")) == PushSpec(
        dataclasses.replace(WeightSyncConfig(), bucket_mb=9), "/r")


def _members(proto) -> set[str]:
    own = {n for n in vars(proto) if not n.startswith("_")} - {"streams_buckets"}
    return own | set(getattr(proto, "__annotations__", {}))


@pytest.mark.parametrize("cls,streams", [(DistributedTransport, True), (TensorTransport, True),
                                         (DiskTransport, False)])
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
