"""A learned reward: (prompt, completion) scored by reward-model servers over SGLang's /classify.

    rollout.reward_fn: megarl.rewards.model:RewardModel
    reward.args: {urls: [http://127.0.0.1:31000], api_key: null, label: 0, tokenizer: null,
                  template: "{prompt}{completion}", max_batch: 32, max_wait_ms: 10,
                  timeout_s: 60, retries: 2, retry_backoff_s: 0.5}

The servers are `megarl-server` on an HF ``*ForSequenceClassification`` checkpoint
(`megarl.server.reward`) or SGLang started with ``--is-embedding`` on one; both take

    POST {url}/classify  {"text": [str, ...]}  or  {"input_ids": [[int, ...], ...]}
    200  [{"embedding": [float] * num_labels, "meta_info": {...}}, ...]   one per input, in order

and the reward of a sample is ``embedding[label]``. The scored text is ``template`` filled with
the prompt and the completion; with ``tokenizer`` (an HF model dir) the client tokenizes it
itself (BOS added, as the servers do for text) and sends ``input_ids``.

Batching is `HttpReward`'s: concurrent calls share a POST of up to ``max_batch`` items, sent when
full or ``max_wait_ms`` after the first. Batches go round-robin over ``urls``; a batch that fails
(connection refused or reset, ``timeout_s`` passed, HTTP 5xx, a malformed body) is retried on the
next server after ``retry_backoff_s * 2**attempt`` seconds, up to ``retries`` times, and then every
caller in it gets a `RewardModelError` naming the servers and the last failure. A 4xx (a bad
request, a missing API key, a server that is not a reward model) is not retried.
"""
from __future__ import annotations

import asyncio
import json
from typing import Optional, Union

import aiohttp

from megarl.rewards.http import HttpReward, HttpRewardError

__all__ = ["RewardModel", "RewardModelError"]


class RewardModelError(HttpRewardError):
    """The reward-model servers failed, refused the batch or answered another shape."""


class _Refused(Exception):
    """A 4xx: the same batch would be refused again."""


class RewardModel(HttpReward):
    def __init__(self, urls: Union[str, list[str]], api_key: Optional[str] = None, label: int = 0,
                 tokenizer: Optional[str] = None, template: str = "{prompt}{completion}",
                 max_batch: int = 32, max_wait_ms: float = 10.0, timeout_s: float = 60.0,
                 retries: int = 2, retry_backoff_s: float = 0.5):
        urls = [urls] if isinstance(urls, str) else list(urls or [])
        if not urls:
            raise ValueError("reward.args.urls: at least one reward-model server URL is required")
        for u in urls:
            if not isinstance(u, str) or not u.startswith(("http://", "https://")):
                raise ValueError(f"reward.args.urls: expected http(s)://host:port, got {u!r}")
        if isinstance(label, bool) or not isinstance(label, int) or label < 0:
            raise ValueError(f"reward.args.label: expected an index >= 0, got {label!r}")
        if retry_backoff_s < 0:
            raise ValueError(f"reward.args.retry_backoff_s: expected >= 0, got {retry_backoff_s}")
        try:
            template.format(prompt="", completion="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"reward.args.template: only {{prompt}} and {{completion}} may appear: {e}") from None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        super().__init__(urls[0], max_batch, max_wait_ms, timeout_s, retries, headers)
        self.urls = [u.rstrip("/") for u in urls]
        self.label, self.template, self.retry_backoff_s = label, template, retry_backoff_s
        self.tokenizer = None
        if tokenizer:
            from megarl.common.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(tokenizer)
        self._next = 0  # round-robin position over urls

    def _body(self, items: list[dict]) -> dict:
        texts = [self.template.format(prompt=it["prompt"], completion=it["completion"]) for it in items]
        if self.tokenizer is None:
            return {"text": texts}
        return {"input_ids": [self.tokenizer.encode(t, add_bos=True) for t in texts]}

    async def _post(self, items: list[dict]) -> list[float]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        body = self._body(items)
        failures: list[str] = []
        for attempt in range(self.retries + 1):
            url = self.urls[self._next % len(self.urls)] + "/classify"
            self._next += 1
            try:
                rewards = await self._classify(url, body, len(items))
                self.batches_sent += 1
                return rewards
            except _Refused as e:
                raise RewardModelError(str(e)) from None
            except (aiohttp.ClientError, asyncio.TimeoutError, RewardModelError) as e:
                failures.append(str(e) if isinstance(e, RewardModelError) else f"{url}: {type(e).__name__}: {e}")
            if attempt < self.retries and self.retry_backoff_s > 0:
                await asyncio.sleep(self.retry_backoff_s * 2 ** attempt)
        raise RewardModelError(f"reward model: batch of {len(items)} failed after {len(failures)} attempt(s) "
                               f"on {self.urls}; last: {failures[-1]}")

    async def _classify(self, url: str, body: dict, n: int) -> list[float]:
        async with self._session.post(url, json=body, headers=self.headers) as resp:
            text = await resp.text()
            status = resp.status
        if 400 <= status < 500 and status != 429:
            raise _Refused(f"{url} answered {status}: {text[:300]}")
        if status != 200:
            raise RewardModelError(f"{url} answered {status}: {text[:200]}")
        try:
            outs = json.loads(text)
            if not isinstance(outs, list) or len(outs) != n:
                raise ValueError(f"expected a list of {n} results")
            rewards = [float(o["embedding"][self.label]) for o in outs]
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise RewardModelError(f"{url}: expected [{{'embedding': [score, ...]}}] * {n} "
                                   f"(label {self.label}): {type(e).__name__}: {e}; got {text[:200]}") from None
        return rewards
