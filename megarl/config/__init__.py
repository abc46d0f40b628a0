"""Typed configuration: one dataclass per component, YAML recipes, dotted overrides.

    cfg = load_config("configs/tiny_sft.yaml", ["train.steps=20", "parallel.tp=2"])

Every field has a type and a docstring (the string literal under it). Loading fails at once,
with a one-line :class:`ConfigError` naming the field, on an unknown key, a value of the wrong
type, a value out of its range or a combination of fields that cannot work. Loading reads the
recipe (and, for output paths, whether a directory above one holds another run's config.yaml),
nothing of the model: checks against the model's files (TP not dividing the heads, PP above the
layer count, ...) are `megarl.models.checks.check_against_model`, run by `megarl.launch.preflight`. The
resolved config is written into the run directory by :func:`save_config`.

    load.py      the loader: YAML, overrides, coercion, output paths, save_config
    root.py      Config (one field per section) and the cross-section rules
    model.py     model, parallel, optim, critic sections
    train.py     train, data, checkpoint, logging sections
    rollout.py   rollout, reward, weights sections
    launch.py    launch section
    lora.py      lora section (adapters on the policy)
    eval.py      eval section (megarl-eval)
    common.py    helpers the sections share
    (algo.*: megarl/algo/config.py, next to the RL math it configures)

``from megarl.config import X`` is the way to import any of these names.
"""
from megarl.algo.config import AlgoConfig
from megarl.config.eval import EvalConfig
from megarl.config.launch import LaunchConfig
from megarl.config.lora import LORA_TARGETS, LoRAConfig
from megarl.config.load import (OUTPUT_PATHS, apply_overrides, check_outputs, from_dict, load_config,
                                parse_value, read_yaml, recipe_keys, resolve_outputs, save_config)
from megarl.config.model import CriticConfig, ModelConfig, OptimConfig, ParallelConfig
from megarl.config.rollout import (EnvConfig, RewardConfig, RewardModelConfig, RolloutConfig, TeacherConfig,
                                   WeightSyncConfig)
from megarl.config.root import Config, check_world_size, validate_learning_signal
from megarl.config.train import CheckpointConfig, DataConfig, LoggingConfig, TrainConfig, packs_sequences
from megarl.common.errors import ConfigError

__all__ = [
    "AlgoConfig", "CheckpointConfig", "Config", "ConfigError", "CriticConfig", "DataConfig", "EvalConfig",
    "LaunchConfig", "LORA_TARGETS", "LoRAConfig",
    "LoggingConfig", "ModelConfig", "OUTPUT_PATHS", "OptimConfig", "ParallelConfig", "RewardConfig", "RewardModelConfig",
    "RolloutConfig", "TeacherConfig", "EnvConfig", "TrainConfig", "WeightSyncConfig", "apply_overrides",
    "check_outputs",
    "check_world_size", "from_dict", "load_config", "parse_value", "read_yaml", "recipe_keys",
    "packs_sequences", "resolve_outputs", "save_config", "validate_learning_signal",
]
