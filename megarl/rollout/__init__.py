"""Rollout side of megarl: request/response types, the SGLang-protocol client, the CPU server.

- `megarl.rollout.types`: `ModelRequest`, `ModelResponse`, `SamplingParams` and the admin messages.
- `megarl.rollout.client`: `RolloutClient` (load balancing, retries, partial-rollout resubmission,
  trainer-side admin calls for pause / weight updates).
- `megarl.rollout.server`: `megarl-server`, a CPU SGLang-compatible server for tests and demos.
- `megarl.rollout.workflows`, `.tools`, `.rewards`: what turns a prompt into scored trajectories
  (docs/tasks.md).

Importing this package stays cheap: the client (aiohttp) is imported on first use.
"""

from megarl.rollout.types import (
    DiskWeightsUpdate,
    DistributedWeightsMeta,
    ModelRequest,
    ModelResponse,
    PauseRequest,
    SamplingParams,
    TensorWeightsUpdate,
    WeightsUpdateGroup,
)

_LAZY = {"RolloutClient", "RolloutError", "AdminError", "ServerRequestError"}

__all__ = [
    "DiskWeightsUpdate",
    "DistributedWeightsMeta",
    "ModelRequest",
    "ModelResponse",
    "PauseRequest",
    "SamplingParams",
    "TensorWeightsUpdate",
    "WeightsUpdateGroup",
    *sorted(_LAZY),
]


def __getattr__(name: str):
    if name in _LAZY:
        from megarl.rollout import client

        return getattr(client, name)
    raise AttributeError(f"module 'megarl.rollout' has no attribute {name!r}")
