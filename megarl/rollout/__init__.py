"""The rollout manager's side of megarl: the SGLang-protocol client, the staleness manager, the controller and workflows.

- `megarl.protocol.types`: `ModelRequest`, `ModelResponse`, `SamplingParams` and the admin messages.
- `megarl.rollout.client`: `RolloutClient` (load balancing, retries, partial-rollout resubmission,
  trainer-side admin calls for pause / weight updates).
- `megarl.rollout.workflows`: what turns a prompt into scored trajectories, with the tools of
  `megarl.tools` and the rewards of `megarl.rewards` (docs/tasks.md).

The CPU inference server is a program of its own (`megarl.server`, `megarl-server`) that shares
only the wire types (`megarl.protocol.wire`) with this package.

Importing this package stays cheap: the client (aiohttp) is imported on first use.
"""

from megarl.protocol.types import (
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
