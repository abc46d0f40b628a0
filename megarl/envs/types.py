"""The environment protocol's bodies: gym's reset / step, with OpenAI-style chat messages.

    POST /reset  {"episode_id": str, "task": {"prompt": str, "meta": {...}}, "seed": int | null}
             ->  {"info": {...}}
    POST /step   {"episode_id": str, "action": Action}
             ->  {"observation": [message, ...], "reward": float, "done": bool, "info": {...}}
    POST /close  {"episode_id": str}                 -> {"closed": bool}
    GET  /info   -> {"tools": [OpenAI function schema, ...], "env": "pkg.module:Class"}
    GET  /health -> {"ok": true}        GET /stats -> counters (episodes, steps, failures, ...)

An action is the policy's assistant turn as an OpenAI chat message: its text, and the tool calls
parsed from it (``{"id", "type": "function", "function": {"name", "arguments": JSON text}}``).
An observation is a list of messages the environment answers with: ``{"role": "user", "content"}``
or ``{"role": "tool", "tool_call_id", "name", "content"}`` - what the chat template renders as
the next turns. The first observation is the dataset's prompt itself (the trainer's exactly-once
ledger counts prompts), so reset returns no messages: it binds the episode to its task.

Every body is checked on both sides (`parse_*`): a malformed one is a `ProtocolError` whose one
line names the field.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

__all__ = ["ProtocolError", "Task", "ToolCallMsg", "Action", "StepResult", "ResetResult", "OBSERVATION_ROLES",
           "parse_reset_request", "parse_step_request", "parse_step_result", "parse_reset_result",
           "parse_messages"]

OBSERVATION_ROLES = ("user", "tool")
MAX_ID_CHARS = 128


class ProtocolError(ValueError):
    """A request or answer that does not follow the protocol; its message names the field."""


@dataclass
class Task:
    """What an episode is about: the dataset prompt (text as the model saw it) and its row's
    fields (``meta``: e.g. the answer a verifier compares against)."""

    prompt: str = ""
    meta: dict = field(default_factory=dict)


@dataclass
class ToolCallMsg:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def parsed_arguments(self) -> dict:
        """The arguments as an object; ProtocolError if they are not a JSON object."""
        try:
            args = json.loads(self.arguments) if self.arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise ProtocolError(f"tool call {self.name!r}: arguments are not JSON ({e.msg})") from None
        if not isinstance(args, dict):
            raise ProtocolError(f"tool call {self.name!r}: arguments must be a JSON object")
        return args

    def to_json(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Action:
    """One assistant turn: its text (tool-call blocks included) and the calls parsed from it."""

    content: str
    tool_calls: list[ToolCallMsg] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"role": "assistant", "content": self.content, "tool_calls": [c.to_json() for c in self.tool_calls]}


@dataclass
class StepResult:
    observation: list[dict] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class ResetResult:
    info: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"info": self.info}


# ---- checks ------------------------------------------------------------------------------------

def _obj(body: Any, where: str) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError(f"{where}: expected a JSON object, got {type(body).__name__}")
    return body


def _str(body: dict, key: str, where: str, required: bool = True, default: str = "") -> str:
    if key not in body or body[key] is None:
        if required:
            raise ProtocolError(f"{where}.{key}: missing")
        return default
    if not isinstance(body[key], str):
        raise ProtocolError(f"{where}.{key}: expected a string, got {type(body[key]).__name__}")
    return body[key]


def _dict(body: dict, key: str, where: str) -> dict:
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError(f"{where}.{key}: expected an object, got {type(value).__name__}")
    return value


def _episode_id(body: dict, where: str) -> str:
    eid = _str(body, "episode_id", where)
    if not eid or len(eid) > MAX_ID_CHARS:
        raise ProtocolError(f"{where}.episode_id: must be 1..{MAX_ID_CHARS} characters")
    return eid


def parse_reset_request(body: Any) -> tuple[str, Task, Optional[int]]:
    body = _obj(body, "reset")
    task = _obj(body.get("task", {}), "reset.task")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ProtocolError(f"reset.seed: expected an integer or null, got {seed!r}")
    return (_episode_id(body, "reset"),
            Task(_str(task, "prompt", "reset.task", required=False), _dict(task, "meta", "reset.task")), seed)


def parse_messages(value: Any, where: str) -> list[dict]:
    """An observation: a list of {"role": user|tool, "content": str, ...} messages."""
    if not isinstance(value, list):
        raise ProtocolError(f"{where}: expected a list of messages, got {type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        m = _obj(m, f"{where}[{i}]")
        role = _str(m, "role", f"{where}[{i}]")
        if role not in OBSERVATION_ROLES:
            raise ProtocolError(f"{where}[{i}].role: {role!r} is not one of {', '.join(OBSERVATION_ROLES)}")
        _str(m, "content", f"{where}[{i}]")
        out.append(dict(m))
    return out


def _action(body: Any) -> Action:
    body = _obj(body, "step.action")
    calls = body.get("tool_calls")
    calls = [] if calls is None else calls
    if not isinstance(calls, list):
        raise ProtocolError("step.action.tool_calls: expected a list")
    parsed = []
    for i, c in enumerate(calls):
        where = f"step.action.tool_calls[{i}]"
        c = _obj(c, where)
        fn = _obj(c.get("function"), f"{where}.function")
        args = fn.get("arguments", "")
        if isinstance(args, dict):  # an object instead of JSON text: accepted as the text it stands for
            args = json.dumps(args)
        if not isinstance(args, str):
            raise ProtocolError(f"{where}.function.arguments: expected JSON text")
        parsed.append(ToolCallMsg(_str(c, "id", where, required=False, default=f"call_{i}"),
                                  _str(fn, "name", f"{where}.function"), args))
    return Action(_str(body, "content", "step.action", required=False), parsed)


def parse_step_request(body: Any) -> tuple[str, Action]:
    body = _obj(body, "step")
    eid = _episode_id(body, "step")
    if "action" not in body:
        raise ProtocolError("step.action: missing")
    return eid, _action(body["action"])


def parse_step_result(body: Any, where: str = "step result") -> StepResult:
    body = _obj(body, where)
    reward = body.get("reward", 0.0)
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ProtocolError(f"{where}.reward: expected a finite number, got {reward!r}")
    done = body.get("done", False)
    if not isinstance(done, bool):
        raise ProtocolError(f"{where}.done: expected true or false, got {done!r}")
    return StepResult(parse_messages(body.get("observation", []), f"{where}.observation"), float(reward), done,
                      _dict(body, "info", where))


def parse_reset_result(body: Any, where: str = "reset result") -> ResetResult:
    body = _obj(body, where)
    if body.get("observation"):
        raise ProtocolError(f"{where}.observation: reset answers no messages (the dataset prompt is the "
                            "first observation)")
    return ResetResult(_dict(body, "info", where))
