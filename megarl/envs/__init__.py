"""Environments in their own processes: gym's reset / step over HTTP (docs/environments.md).

    megarl.envs.types    the protocol's bodies (Task, Action, StepResult) and their checks
    megarl.envs.base     `Environment`, the class an environment is written as
    megarl.envs.server   megarl-env: serves one class, many episodes, keyed, one failure = one episode
    megarl.envs.client   `EnvClient`: the workflows' side (`EnvError` ends an episode)
    megarl.envs.examples shipped environments (calculator tool, guess-the-number, sandboxed Python)
"""
from megarl.envs.base import Environment, load_environment
from megarl.envs.client import EnvClient, EnvEpisode, EnvError
from megarl.envs.types import Action, ProtocolError, ResetResult, StepResult, Task, ToolCallMsg

__all__ = ["Action", "EnvClient", "EnvEpisode", "EnvError", "Environment", "ProtocolError", "ResetResult",
           "StepResult", "Task", "ToolCallMsg", "load_environment"]
