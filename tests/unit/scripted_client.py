"""Test double for the rollout client + server: `agenerate` answers from a script, not a model.

Call i (in arrival order) returns the tokens of the next scripted text plus EOS (cut to the
request's max_new_tokens), logprob -(j + 1) / 100 for token j, and versions that change inside
the response - the first half at version 2i, the rest at 2i + 1 - as if a weight update had
interrupted it (a partial rollout). Every request and response is recorded.
"""
from __future__ import annotations

import asyncio

from megarl.protocol.types import ModelRequest, ModelResponse


class ScriptedClient:
    def __init__(self, tokenizer, script: list[str]):
        self.tokenizer, self.script = tokenizer, script
        self.calls: list[tuple[ModelRequest, ModelResponse]] = []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        i = len(self.calls)
        ids = self.tokenizer.encode(self.script[i % len(self.script)]) + [self.tokenizer.eos_id]
        ids = ids[: req.sampling.max_new_tokens]
        half = len(ids) // 2
        resp = ModelResponse(
            input_tokens=list(req.input_ids), output_tokens=ids,
            output_logprobs=[-(j + 1) / 100 for j in range(len(ids))],
            output_versions=[2 * i] * half + [2 * i + 1] * (len(ids) - half),
            stop_reason="stop" if ids and ids[-1] == self.tokenizer.eos_id else "length",
            rid=req.rid, num_segments=2)
        self.calls.append((req, resp))
        await asyncio.sleep(0)  # let concurrent episodes interleave
        return resp

    async def agenerate_n(self, req: ModelRequest, n: int) -> list[ModelResponse]:
        return list(await asyncio.gather(*(self.agenerate(ModelRequest(list(req.input_ids), req.sampling))
                                           for _ in range(n))))
