"""Compatibility path for ``rollout.workflow: megarl.rollout.workflow:SingleTurnWorkflow`` (the
config default): the workflows live in `megarl.rollout.workflows`."""
from megarl.rollout.workflows import (LongTailWorkflow, MultiTurnWorkflow, RolloutWorkflow, SingleTurnWorkflow, ToolCallingWorkflow,
                                      WorkflowContext, load_workflow)

__all__ = ["LongTailWorkflow", "MultiTurnWorkflow", "RolloutWorkflow", "SingleTurnWorkflow", "ToolCallingWorkflow", "WorkflowContext",
           "load_workflow"]
