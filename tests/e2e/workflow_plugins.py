"""Workflow plugins used by the e2e tests (loaded by import path, as users' workflows are)."""
from __future__ import annotations

import dataclasses

from megarl.rollout.workflows import SingleTurnWorkflow


class RefusedTopK(SingleTurnWorkflow):
    """SingleTurnWorkflow whose requests ask for top_k past the model's vocabulary: the server
    refuses every one of them with HTTP 400."""

    def __init__(self, ctx, **kwargs):
        super().__init__(dataclasses.replace(ctx, sampling=dataclasses.replace(ctx.sampling, top_k=1000)), **kwargs)
