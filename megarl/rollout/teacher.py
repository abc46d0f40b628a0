"""On-policy distillation's teacher, as the rollout manager calls it: each finished group's
samples scored token by token by the teacher servers (teacher.path, started by the manager).

    POST /generate {"input_ids": [sample, ...], "sampling_params": {"max_new_tokens": 0},
                    "return_logprob": true, "logprob_start_len": k}
    -> per sample meta_info.input_token_logprobs [[logprob, token_id, _], ...] from position k

(SGLang's request shape for scoring a prompt; megarl-server answers it, `megarl.server.requests`.)
k is the group's first generated position, so one request scores the group, and each generated
token j (loss_mask 1, also between the tool or environment turns of a multi-turn sample) gets the
teacher's log pi_T(y_j | y_<j) in ``Trajectory.teacher_logp`` (0.0 elsewhere). A failed call is
retried on the next server (``retries``, backing off); then the episode fails like any rollout
error (the controller retries it, `rollout.max_retries`).
"""
from __future__ import annotations

import asyncio
from typing import Optional

from megarl.protocol.types import Trajectory
from megarl.rollout.http import HttpClient, RolloutError, Transient, backoff_delay

__all__ = ["TeacherClient", "TeacherError"]


class TeacherError(RolloutError):
    """The teacher servers failed, or answered another shape."""


class TeacherClient(HttpClient):
    def __init__(self, addresses: list[str], api_key: Optional[str] = None, timeout_s: float = 60.0,
                 retries: int = 2, backoff_s: float = 0.5):
        super().__init__(addresses, api_key)
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self._next = 0
        self.stats = {"teacher/requests": 0, "teacher/tokens": 0, "teacher/retries": 0}

    async def score(self, group: list[Trajectory]) -> None:
        """Sets ``teacher_logp`` of every sample of ``group`` (one request for the group)."""
        firsts = [t.loss_mask.index(1) for t in group if 1 in t.loss_mask]
        if not firsts:  # nothing generated: nothing to score
            for t in group:
                t.teacher_logp = [0.0] * len(t.input_ids)
            return
        start = min(firsts)
        body = {"input_ids": [list(t.input_ids) for t in group], "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True, "logprob_start_len": start}
        out = await self._post(body)
        if not isinstance(out, list) or len(out) != len(group):
            raise TeacherError(f"teacher /generate: expected a list of {len(group)} results, got {str(out)[:200]}")
        for t, res in zip(group, out):
            t.teacher_logp = self._aligned(t, res, start)
        self.stats["teacher/requests"] += 1
        self.stats["teacher/tokens"] += sum(sum(t.loss_mask) for t in group)

    @staticmethod
    def _aligned(t: Trajectory, res, start: int) -> list[float]:
        try:
            entries = res["meta_info"]["input_token_logprobs"]
        except (TypeError, KeyError):
            raise TeacherError(f"teacher /generate: no meta_info.input_token_logprobs in {str(res)[:200]}") from None
        if len(entries) != len(t.input_ids) - start:
            raise TeacherError(f"teacher /generate: {len(entries)} prompt logprobs for positions {start}.."
                               f"{len(t.input_ids) - 1} of a {len(t.input_ids)}-token sample")
        out = [0.0] * len(t.input_ids)
        for j, m in enumerate(t.loss_mask):
            if m:
                lp, token = entries[j - start][0], entries[j - start][1]
                if lp is None or token != t.input_ids[j]:
                    raise TeacherError(f"teacher /generate: position {j} scored token {token} as {lp}, "
                                       f"the sample has {t.input_ids[j]}")
                out[j] = float(lp)
        return out

    async def _post(self, body: dict):
        last: Optional[BaseException] = None
        for attempt in range(self.retries + 1):
            srv = self.servers[self._next % len(self.servers)]
            self._next += 1
            try:
                return await self._call(srv, "POST", "/generate", body, self.timeout_s)
            except Transient as e:
                last = e
                if attempt < self.retries:
                    self.stats["teacher/retries"] += 1
                    await asyncio.sleep(backoff_delay(attempt, self.backoff_s, 8.0))
        raise TeacherError(f"teacher servers {', '.join(self.addresses)}: {last}")
