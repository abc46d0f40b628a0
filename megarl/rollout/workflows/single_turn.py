"""Single-turn RLVR (the GRPO default): `group_size` samples of the prompt, each scored by the
reward function on its decoded completion (text up to the first EOS)."""
from __future__ import annotations

from typing import Optional

from megarl.data.prompts import PromptSample
from megarl.protocol.types import ModelRequest, Trajectory
from megarl.rollout.workflows.base import TokenTrace, WorkflowContext, completion_text

__all__ = ["SingleTurnWorkflow"]


class SingleTurnWorkflow:
    """prompt -> group_size completions -> rewards. Options: `group_size` overrides the context's.

    Rejects (None) a prompt that leaves no room for a token within ``train.max_seq_len``;
    generation stops there otherwise (max_new_tokens is capped by the room left)."""

    def __init__(self, ctx: WorkflowContext, group_size: Optional[int] = None):
        self.ctx = ctx
        self.group_size = group_size or ctx.group_size

    def completion_text(self, tokens: list[int]) -> str:
        return completion_text(self.ctx.tokenizer, tokens)

    async def arun_episode(self, client, sample: PromptSample) -> Optional[list[Trajectory]]:
        prompt = list(sample.prompt_ids)
        budget = self.ctx.budget(len(prompt))
        if budget == 0:
            return None
        sampling = self.ctx.sampling_for(sample, budget)
        responses = await client.agenerate_n(ModelRequest(prompt, sampling), self.group_size)
        return await self.score(sample, responses)

    async def score(self, sample: PromptSample, responses) -> list[Trajectory]:
        """Rewards of the decoded completions and one Trajectory per response."""
        texts = [self.completion_text(r.output_tokens) for r in responses]
        rewards = await self.ctx.reward.many(sample.prompt, texts, sample.meta)
        out = []
        for r, reward, text in zip(responses, rewards, texts):
            trace = TokenTrace(list(r.input_tokens))
            trace.add_generated(r)
            out.append(trace.to_trajectory(reward, sample.index, {
                "completion": text, "stop_reason": r.stop_reason, "segments": r.num_segments}))
        return out
