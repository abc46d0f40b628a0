"""Rollout workflows: how one prompt becomes a group of scored trajectories (contract, context
and checker in `base`). Shipped: `SingleTurnWorkflow` (RLVR, the GRPO default),
`LongTailWorkflow` (long-tailed lengths, for benchmarks), `MultiTurnWorkflow` (environment
feedback as new turns), `ToolCallingWorkflow` (Hermes/Qwen tool calls run by `megarl.tools`) and
`EnvironmentWorkflow` (environment servers, `megarl.envs`). Configs name them as
``megarl.rollout.workflows:ToolCallingWorkflow``.
"""
from megarl.rollout.workflows.environment import EnvironmentWorkflow
from megarl.rollout.workflows.base import (RolloutWorkflow, TokenTrace, WorkflowContext, check_episode,
                                           load_workflow)
from megarl.rollout.workflows.long_tail import LongTailWorkflow
from megarl.rollout.workflows.multi_turn import EnvStep, MultiTurnWorkflow
from megarl.rollout.workflows.single_turn import SingleTurnWorkflow
from megarl.rollout.workflows.tool_calling import ToolCall, ToolCallingWorkflow, parse_tool_calls
from megarl.rollout.workflows.turns import TurnRenderer

__all__ = [
    "EnvStep",
    "EnvironmentWorkflow",
    "LongTailWorkflow",
    "MultiTurnWorkflow",
    "RolloutWorkflow",
    "SingleTurnWorkflow",
    "TokenTrace",
    "ToolCall",
    "ToolCallingWorkflow",
    "TurnRenderer",
    "WorkflowContext",
    "check_episode",
    "load_workflow",
    "parse_tool_calls",
]
