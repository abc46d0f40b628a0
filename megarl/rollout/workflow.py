"""Compatibility path for ``rollout.workflow: megarl.rollout.workflow:SingleTurnWorkflow`` (the
config default): the workflows live in `megarl.rollout.workflows`."""
from megarl.rollout.workflows import (MultiTurnWorkflow, RolloutWorkflow, SingleTurnWorkflow, ToolCallingWorkflow,
                                      WorkflowContext, load_workflow)

__all__ = ["MultiTurnWorkflow", "RolloutWorkflow", "SingleTurnWorkflow", "ToolCallingWorkflow", "WorkflowContext",
           "load_workflow"]
