"""Environment servers the job starts itself (``env.cls``): megarl-env processes beside the policy
servers, keyed, health-checked and restarted like the reward-model servers (`RewardServers`).

    rollout manager
      env_servers(env)  ── LocalServers: env.servers x megarl-env ENV.CLS --args ENV.ARGS
        watch thread, every env.health_interval_s: a dead process, or two failed /health probes
        in a row -> relaunched on its own port (its open episodes are lost: each fails with
        EnvError and is run again, env.episode_retries, then rollout.max_retries)
      TaskSpec.env = {urls, api_key, ...}: the workflows' EnvClient (controller and evaluation)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import TYPE_CHECKING

from megarl.common.signals import owned_child_setup
from megarl.rollout.local import MegarlLauncher, key_pipe
from megarl.rollout.reward_servers import RewardServers

if TYPE_CHECKING:
    from megarl.config import EnvConfig

__all__ = ["EnvLauncher", "env_servers"]


class EnvLauncher:
    """Spawns one megarl-env per `LocalServers` slot (``cmd`` + host and port); the key reaches it
    through a pipe."""

    name = "megarl-env"
    kill = staticmethod(MegarlLauncher.kill)

    def __init__(self, cmd: list[str], api_key: str):
        self.cmd, self.api_key = list(cmd), api_key

    def spawn(self, port: int, log_path: str, host: str, cpus=None) -> subprocess.Popen:
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        cmd = [*self.cmd, "--host", host, "--port", str(port)]
        with open(log_path, "a") as log, key_pipe(self.api_key) as fds:
            cmd += ["--api-key-fd", str(fds[0])]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=owned_child_setup,
                                    pass_fds=fds)
        if cpus:
            os.sched_setaffinity(proc.pid, cpus)
        return proc


def env_servers(env: "EnvConfig", log_dir: str, host: str, cpus=None,
                ready_timeout_s: float = 60.0) -> RewardServers:
    """``with env_servers(cfg.env, ...) as urls:`` env.servers megarl-env processes serving
    env.cls with env.args, each answered /health; ``.api_key`` is theirs, ``.restarts`` counts relaunches."""
    cmd = [sys.executable, "-m", "megarl.envs", env.cls, "--args", json.dumps(env.args),
           "--max-episodes", str(env.max_episodes), "--step-timeout-s", str(env.step_timeout_s),
           "--episode-ttl-s", str(env.episode_ttl_s)]
    served = SimpleNamespace(path=env.cls, servers=env.servers, threads=1, health_interval_s=env.health_interval_s)
    return RewardServers(served, log_dir, host, cpus, ready_timeout_s, field="env.cls",
                         make_launcher=lambda key: EnvLauncher(cmd, key), what="environment")
