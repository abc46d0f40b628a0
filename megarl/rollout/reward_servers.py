"""Reward-model servers the job starts itself (``reward.model``): megarl-server on an HF sequence
classifier, beside the policy servers, health-checked and restarted like them.

    rollout manager
      RewardServers(reward.model)  ── LocalServers: reward.model.servers x megarl-server --model PATH
        watch thread, every reward.model.health_interval_s:
          process dead, or /health failed twice in a row  -> LocalServers.restart (same port),
          then up to rollout.health_timeout_s for it to answer before it is judged again
      RewardModel(urls=these servers)  (reward.args.urls filled in: `with_reward_urls`)

The policy servers are dropped from the server set while they are down and re-admitted once they
hold the current weights; a reward-model server holds no weights of the run, so it is never
dropped: RewardModel sends each batch round-robin and retries a failed one on the next server
(reward.args.retries), which covers the seconds a restart takes.

On-policy distillation's teacher (``teacher``: megarl-server on an HF causal LM) is served the same
way, `RewardServers(teacher, ..., field="teacher.path")`; `megarl.rollout.teacher.TeacherClient`
retries its scoring calls on the next server likewise.
"""
from __future__ import annotations

import dataclasses
import secrets
import json
import logging
import os
import threading
import time
import urllib.request
from typing import Optional

from megarl.common.errors import ConfigError
from megarl.rollout.local import LocalServers

log = logging.getLogger("megarl.reward_servers")

PROBE_TIMEOUT_S = 3.0  # one /health probe (the policy servers' probe deadline too)
FAILED_PROBES = 2  # in a row before a live process is restarted (one slow answer is not a death)


def check_reward_model(path: str) -> None:
    """reward.model.path is an HF sequence-classifier directory a server can load: config.json
    naming a ``*ForSequenceClassification`` architecture, and safetensors weights. ConfigError
    naming the field otherwise (megarl-train's preflight)."""
    field = "reward.model.path"
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise ConfigError(f"{field}: {path} is not a directory")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{field}: cannot read {cfg_path}: {e}") from None
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    arch = archs[0] if isinstance(archs, list) and archs else None
    if not isinstance(arch, str) or not arch.endswith("ForSequenceClassification"):
        raise ConfigError(f"{field}: {cfg_path} names architecture {arch!r}, not a reward model "
                          "(an HF *ForSequenceClassification checkpoint)")
    if not any(n.endswith(".safetensors") for n in os.listdir(path)):
        raise ConfigError(f"{field}: no *.safetensors weights in {path}")


def task_with_reward_urls(task, urls: list[str], api_key: str):
    """``task`` (a `TaskSpec`) with reward.args.urls = ``urls`` and their ``api_key``."""
    args = {**task.reward.args, "urls": list(urls), "api_key": api_key}
    return dataclasses.replace(task, reward=dataclasses.replace(task.reward, args=args))


def with_reward_urls(spec, urls: list[str], api_key: str):
    """``spec`` (a frozen spec holding ``task: TaskSpec``) with reward.args.urls = ``urls``."""
    return dataclasses.replace(spec, task=task_with_reward_urls(spec.task, urls, api_key))


def healthy(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:
        return False


class RewardServers:
    """``with RewardServers(reward.model, log_dir, ...) as urls:`` the started servers (each has
    answered /health), watched and restarted until the context ends."""

    def __init__(self, model_cfg, log_dir: str, host: str, cpus=None, ready_timeout_s: float = 120.0,
                 field: str = "reward.model.path", make_launcher=None, what: str = "reward-model"):
        self.cfg, self.ready_timeout_s, self.field = model_cfg, ready_timeout_s, field  # field: named in errors
        self.what = what  # in the restart warnings
        self.api_key = secrets.token_urlsafe(32)  # like the policy servers: only this run's requests
        # make_launcher(api_key): what each slot runs instead of megarl-server (the environment servers)
        launcher = make_launcher(self.api_key) if make_launcher is not None else None
        self.local = LocalServers(model_cfg.path, model_cfg.servers, log_dir, extra=["--threads", model_cfg.threads],
                                  host=host, cpus=cpus, ready_timeout_s=ready_timeout_s, api_key=self.api_key,
                                  launcher=launcher)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def restarts(self) -> int:
        return self.local.restarts

    def __enter__(self) -> list[str]:
        try:
            urls = self.local.__enter__()
        except RuntimeError as e:  # e.g. "megarl-server exited early (log ...): <why>"
            raise ConfigError(f"{self.field}: {self.cfg.path}: {e}") from None
        self._thread = threading.Thread(target=self._watch, name="megarl-rm-health", daemon=True)
        self._thread.start()
        return list(urls)

    def _watch(self) -> None:
        failed = {u: 0 for u in self.local.urls}
        grace: dict[str, float] = {}  # url -> until when a restarted server may be silent
        while not self._stop.wait(self.cfg.health_interval_s):
            for i, url in enumerate(list(self.local.urls)):
                if self._stop.is_set():
                    return
                dead = self.local.procs[i].poll() is not None
                if not dead and healthy(url):
                    failed[url] = 0
                    grace.pop(url, None)
                    continue
                if not dead and time.monotonic() < grace.get(url, 0.0):
                    continue  # restarted, still starting
                failed[url] += 1
                if dead or failed[url] >= FAILED_PROBES:
                    log.warning("%s server %s %s; restarting it", self.what, url,
                                "exited" if dead else f"failed {failed[url]} health probes")
                    self.local.restart(url)
                    failed[url] = 0
                    grace[url] = time.monotonic() + self.ready_timeout_s

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=PROBE_TIMEOUT_S * 2 + 1)
        self.local.close()

    def __exit__(self, *exc) -> None:
        self.close()
