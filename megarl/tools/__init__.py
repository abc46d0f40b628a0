"""Tools a policy may call during a rollout, and how calls are run.

A tool is an object with `name`, `description`, `parameters` (a JSON schema of its arguments,
shown to the model through the chat template's ``tools``) and

    async def __call__(self, **arguments) -> str

Built-ins: ``calculator`` (`CalculatorTool`: whitelisted-AST arithmetic, no eval) and ``python``
(`PythonTool`: a snippet in a resource-limited subprocess; limits in its module docstring).
`build_tools` takes ``workflow_args.tools`` entries: a built-in name, ``{"name": ..., **options}``
or ``"package.module:Class"`` (built without arguments). `run_tool_call` never raises: unknown
tools, bad arguments, exceptions and timeouts come back as ``"error: ..."`` text for the model.
"""
from __future__ import annotations

import asyncio
import importlib
from typing import Any, Protocol, Union

from megarl.tools.calculator import CalculatorTool
from megarl.tools.python_sandbox import PythonTool

__all__ = ["Tool", "CalculatorTool", "PythonTool", "BUILTIN_TOOLS", "build_tools", "tool_schema", "run_tool_call"]

BUILTIN_TOOLS = {"calculator": CalculatorTool, "python": PythonTool}


class Tool(Protocol):
    name: str
    description: str
    parameters: dict

    async def __call__(self, **arguments: Any) -> str: ...


def tool_schema(tool: Tool) -> dict:
    """The OpenAI/HF function schema chat templates render for ``tools``."""
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": tool.parameters}}


def build_tools(specs: list[Union[str, dict]]) -> dict[str, Tool]:
    tools: dict[str, Tool] = {}
    for spec in specs:
        options = dict(spec) if isinstance(spec, dict) else {}
        name = options.pop("name", None) if isinstance(spec, dict) else spec
        if name in BUILTIN_TOOLS:
            tool = BUILTIN_TOOLS[name](**options)
        elif isinstance(name, str) and ":" in name:
            module, _, attr = name.partition(":")
            try:
                tool = getattr(importlib.import_module(module), attr)(**options)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"workflow_args.tools: cannot load {name!r}: {e}") from None
        else:
            raise ValueError(f"workflow_args.tools: unknown tool {spec!r} (built-ins: {sorted(BUILTIN_TOOLS)}, "
                             "or 'package.module:Class')")
        if tool.name in tools:
            raise ValueError(f"workflow_args.tools: two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools


async def run_tool_call(tools: dict[str, Tool], name: str, arguments: dict, timeout_s: float,
                        max_chars: int = 2000) -> tuple[str, bool]:
    """(result text, ok) of one call; never raises. Results are cut to `max_chars` characters."""
    tool = tools.get(name)
    if tool is None:
        return f"error: unknown tool {name!r}; available: {', '.join(sorted(tools))}", False
    try:
        text, ok = str(await asyncio.wait_for(tool(**arguments), timeout_s)), True
    except asyncio.TimeoutError:
        text, ok = f"error: {name} timed out after {timeout_s} s", False
    except TypeError as e:
        text, ok = f"error: bad arguments for {name}: {e}", False
    except Exception as e:  # noqa: BLE001 - the model sees the failure instead of the episode dying
        text, ok = f"error: {type(e).__name__}: {e}", False
    if len(text) > max_chars:
        text = text[:max_chars] + f"... [{len(text) - max_chars} characters cut]"
    return text, ok
