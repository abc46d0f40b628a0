"""Program 2, the rollout manager (`megarl.rollout.manager`): the SGLang-protocol client, the
staleness manager, the controller, workflows, evaluation and the server set.

- `megarl.rollout.types`: `Trajectory`, `ModelRequest`, `ModelResponse`, `SamplingParams` and the
  admin messages, as plugins import them (they live on the shared floor, `megarl.protocol.types`).
- `megarl.rollout.client`: `RolloutClient` (load balancing, retries, partial-rollout resubmission);
  `megarl.rollout.admin`: the admin calls for pause / weight updates.
- `megarl.rollout.workflows`: what turns a prompt into scored trajectories, with the tools of
  `megarl.tools` and the rewards of `megarl.rewards` (docs/tasks.md).

Nothing here imports the trainer side (`megarl.trainer`, `weights`, `models`, `checkpoint`,
`mcore`), and the trainer imports nothing of this package: what the two share is on the floor,
`megarl.protocol` (tests/unit/test_import_rules.py). The CPU inference server is a program of its
own (`megarl.server`, `megarl-server`) that shares only that floor with this package.

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
