"""Environments for the environment-protocol tests (served in-process by tests/unit/test_envs.py and
by megarl-env subprocesses in tests/e2e/test_env_server.py, which put this directory on PYTHONPATH)."""
from __future__ import annotations

import asyncio
import os
import time

from megarl.envs import Environment, StepResult

FAILS = {"raise", "hang", "bad_result", "bad_reward"}


class Echo(Environment):
    """Answers each turn with "echo: <text>" as a user turn; done (reward 1) once the turn says
    "stop". meta["fail"] in FAILS misbehaves at the first step; meta["reset_fail"] at reset."""

    tools = [{"type": "function", "function": {"name": "noop", "description": "nothing",
                                               "parameters": {"type": "object", "properties": {}}}}]

    def __init__(self, hang_s: float = 60.0):
        self.hang_s = hang_s
        self.turns = 0

    def reset(self, task, seed):
        if task.meta.get("reset_fail"):
            raise RuntimeError("reset refused")
        self.meta, self.seed = task.meta, seed
        return {"seed": seed}

    async def step(self, action):
        self.turns += 1
        fail = self.meta.get("fail")
        if fail == "raise":
            raise RuntimeError("environment bug")
        if fail == "hang":
            await asyncio.sleep(self.hang_s)
        if fail == "bad_result":
            return {"reward": 1}
        if fail == "bad_reward":
            return StepResult(reward=float("nan"))
        if "stop" in action.content:
            return StepResult(reward=1.0, done=True, info={"turns": self.turns})
        names = [c.name for c in action.tool_calls]
        return StepResult([{"role": "user", "content": f"echo: {action.content} {names}"}], reward=0.25,
                          info={"turns": self.turns})


class FailOnce(Environment):
    """The first episode of each process whose task asks for it raises at its first step (a file
    in meta["marker_dir"] remembers it across processes); later ones answer "ok" and end."""

    def reset(self, task, seed):
        self.meta = task.meta

    def step(self, action):
        marker = os.path.join(self.meta["marker_dir"], f"failed-{self.meta['key']}")
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return StepResult(reward=1.0, done=True)
        os.close(fd)
        raise RuntimeError("first try fails")


EVENTS: list[str] = []  # what SlowSync instances did, in order (in-process tests read it)


class SlowSync(Environment):
    """A blocking step (time.sleep, meta["delay_s"] or `delay_s`): runs in a worker thread, the
    server keeps answering others. Records "step-end <id>" and "close <id>" in EVENTS."""

    def __init__(self, delay_s: float = 0.5):
        self.delay_s = delay_s

    def reset(self, task, seed):
        self.delay_s = task.meta.get("delay_s", self.delay_s)
        self.id = task.meta.get("id", "")

    def step(self, action):
        time.sleep(self.delay_s)
        EVENTS.append(f"step-end {self.id}")
        return StepResult(reward=1.0, done=True)

    def close(self):
        EVENTS.append(f"close {self.id}")

