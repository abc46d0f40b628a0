"""Single-turn RLVR with long-tailed response lengths, for benchmarks of asynchronous training:
every sample gets its own generation budget from a Pareto law,

    budget_i = min(cap, floor(min_new_tokens * u_i ** (-1 / alpha))),   u_i ~ U(0, 1]

so P(budget > x) = (min_new_tokens / x) ** alpha (alpha = 1: median 2 x min, a few percent at the
cap, the room `rollout.max_new_tokens` and `train.max_seq_len` leave). Run it with
``rollout.ignore_eos: true`` and each sample generates exactly its budget (the reward still reads
the text up to the first EOS). Options via ``rollout.workflow_args``:
{min_new_tokens: 4, alpha: 1.0, seed: 0}. Budgets are seeded by (seed, prompt index, how many times
the prompt was drawn), so a re-run draws the same lengths.
"""
from __future__ import annotations

import asyncio
import math
import random
from typing import Optional

from megarl.data.prompts import PromptSample
from megarl.protocol.types import ModelRequest, Trajectory
from megarl.rollout.workflows.base import WorkflowContext
from megarl.rollout.workflows.single_turn import SingleTurnWorkflow

__all__ = ["LongTailWorkflow"]


class LongTailWorkflow(SingleTurnWorkflow):
    def __init__(self, ctx: WorkflowContext, group_size: Optional[int] = None, min_new_tokens: int = 4,
                 alpha: float = 1.0, seed: int = 0):
        super().__init__(ctx, group_size)
        if min_new_tokens < 1 or alpha <= 0:
            raise ValueError(f"LongTailWorkflow: min_new_tokens >= 1 and alpha > 0 required, got "
                             f"{min_new_tokens}, {alpha}")
        self.min_new_tokens, self.alpha, self.seed = int(min_new_tokens), float(alpha), int(seed)
        self._draws: dict[int, int] = {}

    def budgets(self, prompt_index: int, draw: int, cap: int) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 + prompt_index * 7_919 + draw)
        # 1 - random() is in (0, 1]: the Pareto inverse CDF never divides by zero
        return [min(cap, math.floor(self.min_new_tokens * (1.0 - rng.random()) ** (-1.0 / self.alpha)))
                for _ in range(self.group_size)]

    async def arun_episode(self, client, sample: PromptSample) -> Optional[list[Trajectory]]:
        prompt = list(sample.prompt_ids)
        cap = self.ctx.budget(len(prompt))
        if cap == 0:
            return None
        draw = self._draws.get(sample.index, 0)
        self._draws[sample.index] = draw + 1
        reqs = [ModelRequest(prompt, self.ctx.sampling_for(sample, b))
                for b in self.budgets(sample.index, draw, cap)]
        responses = await asyncio.gather(*(client.agenerate(r) for r in reqs))
        return await self.score(sample, responses)
