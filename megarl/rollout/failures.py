"""How rollouts fail, as the controller reports it to the trainer: a batch that does not come
within the deadline, prompts that keep failing, and what counts as "the same error"."""
from __future__ import annotations

from megarl.rollout.http import ServerRequestError


class RolloutStalled(TimeoutError):
    """No batch within the deadline (train.stall_timeout_s); the message names the stalled phase."""


class RolloutFailed(RuntimeError):
    """Prompts keep failing with one error (rollout.max_consecutive_failures): the run stops."""


def error_key(e: BaseException) -> str:
    """What makes two failures "the same error": a server's refusal by its status and message
    (whichever server said it), anything else by its type and text."""
    if isinstance(e, ServerRequestError):
        return f"HTTP {e.status}: {e.message}"
    return f"{type(e).__name__}: {e}"
