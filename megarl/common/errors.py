"""The error types that the library raises for bad input and the command-line tools report, in
one place: the CLIs (megarl-train, megarl-convert, megarl-logprobs, megarl-launch) import them from
here, as do `megarl.config` and `megarl.launch.preflight` (`CheckpointError`: the checkpoint package and
the megatron-core glue below it); nothing here imports the rest of megarl.

Each message is one line that starts with what is wrong where (the dotted config field, the file
or the flag); the CLIs print it as ``<prog>: <message>`` and exit non-zero, without a traceback.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration value; the message starts with the dotted field name."""


class ToolError(Exception):
    """Bad input or an unusable checkpoint; the message is printed as is (one line)."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the directory or key."""
