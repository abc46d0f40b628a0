"""The workflows' side of the environment protocol: episodes on a set of environment servers.

    async with EnvClient(urls, api_key, timeout_s=30) as env:
        ep = await env.reset(task, seed)          # picks the server with the fewest open episodes
        result = await env.step(ep, action)       # StepResult (checked: `parse_step_result`)
        await env.close(ep)                       # also after done: harmless

An episode stays on the server it was reset on. Any failure - connection refused (a server being
restarted), a deadline, 5xx (the environment raised or overran its step), 404 (the server lost the
episode: restarted or reaped), a malformed answer - raises `EnvError`: that episode is over, and
the workflow decides whether to run it again. A 503 (the server is full) at reset is retried on the
next server, then after a back-off, up to the deadline; so is an unreachable server at reset (one
being restarted: no episode ran there yet).
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import json
import secrets
import urllib.request
from dataclasses import dataclass
from typing import Any, Optional

import aiohttp

from megarl.common.net import normalize_address
from megarl.envs.types import Action, ProtocolError, StepResult, Task, parse_reset_result, parse_step_result

__all__ = ["EnvError", "EnvEpisode", "EnvClient", "fetch_info"]

_ids = itertools.count()


class EnvError(RuntimeError):
    """An environment episode could not go on (its server's one-line reason in the message)."""

    def __init__(self, url: str, message: str, status: Optional[int] = None):
        super().__init__(f"environment {url}: {message}")
        self.url, self.status = url, status


@dataclass
class EnvEpisode:
    id: str
    url: str
    steps: int = 0


def fetch_info(url: str, api_key: Optional[str], timeout_s: float = 10.0) -> dict:
    """GET /info of one server (synchronously: workflows read the tools' schemas when built)."""
    req = urllib.request.Request(normalize_address(url) + "/info",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())
    except (OSError, ValueError) as e:
        raise EnvError(url, f"/info failed: {e}") from None


class EnvClient:
    def __init__(self, urls: list[str], api_key: Optional[str] = None, timeout_s: float = 30.0,
                 connect_timeout_s: float = 5.0, prefix: str = "", episode_retries: int = 1):
        if not urls:
            raise ValueError("EnvClient needs at least one environment server URL")
        self.urls = [normalize_address(u) for u in urls]
        self.api_key, self.timeout_s, self.connect_timeout_s = api_key, timeout_s, connect_timeout_s
        self.prefix = prefix or secrets.token_hex(4) + "-"  # episode ids: <prefix><n>
        self.episode_retries = episode_retries  # the workflow's re-runs of a failed episode (env.episode_retries)
        self.open: dict[str, int] = {u: 0 for u in self.urls}
        # episodes reset, failed (an EnvError once open), re-run by the workflow: the run's env/* metrics
        self.stats: collections.Counter = collections.Counter()
        self._session: Optional[aiohttp.ClientSession] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._tasks: set[asyncio.Task] = set()  # background closes
        self._closed = False

    async def __aenter__(self) -> "EnvClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._tasks:  # background closes still in flight get a moment to land
            await asyncio.wait(list(self._tasks), timeout=self.connect_timeout_s)
        self._closed = True  # a close scheduled after this (a trajectory cancelled late) opens no new session
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._closed:
            raise aiohttp.ClientError("the environment client is closed")
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=headers)
            self._loop = loop
        return self._session

    async def _post(self, url: str, path: str, body: dict) -> tuple[int, Any]:
        t = aiohttp.ClientTimeout(total=self.timeout_s + self.connect_timeout_s, sock_connect=self.connect_timeout_s)
        try:
            async with self._http().post(url + path, json=body, timeout=t) as r:
                text = await r.text()
                try:
                    data = json.loads(text)
                except ValueError:
                    data = text
                return r.status, data
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
            raise EnvError(url, f"{path}: {type(e).__name__}: {e}".rstrip(": ")) from None

    @staticmethod
    def _message(data: Any) -> str:
        return str(data.get("message", data) if isinstance(data, dict) else data)[:500]

    async def reset(self, task: Task, seed: Optional[int] = None) -> EnvEpisode:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        delay, last = 0.05, ""
        while True:
            # the server with the fewest episodes open from here; ties in list order
            for url in sorted(self.urls, key=lambda u: self.open[u]):
                if loop.time() > deadline:
                    break
                eid = f"{self.prefix}{next(_ids)}"  # a new id per try: a try that timed out may have opened one
                body = {"episode_id": eid, "task": {"prompt": task.prompt, "meta": task.meta}, "seed": seed}
                try:
                    status, data = await self._post(url, "/reset", body)
                except EnvError as e:  # unreachable (being restarted?) or no answer: try again
                    last = str(e)
                    self.stats["reset_retries"] += 1
                    self._background(self._close_quietly(url, eid))  # in case the server took it
                    continue
                if status == 503:
                    last = f"environment {url}: every episode slot taken"
                    continue  # full: the next server
                if status != 200:
                    raise EnvError(url, f"/reset: HTTP {status}: {self._message(data)}", status)
                try:
                    parse_reset_result(data)
                except ProtocolError as e:
                    await self._close_quietly(url, eid)
                    raise EnvError(url, f"/reset answered {e}") from None
                self.open[url] += 1
                self.stats["episodes"] += 1
                return EnvEpisode(eid, url)
            if loop.time() + delay > deadline:
                raise EnvError(",".join(self.urls), f"/reset: no server took the episode in {self.timeout_s} s "
                               f"(last: {last})", 503)
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)

    async def step(self, ep: EnvEpisode, action: Action) -> StepResult:
        try:
            status, data = await self._post(ep.url, "/step", {"episode_id": ep.id, "action": action.to_json()})
            if status != 200:
                raise EnvError(ep.url, f"/step of episode {ep.id}: HTTP {status}: {self._message(data)}", status)
            try:
                result = parse_step_result(data)
            except ProtocolError as e:
                raise EnvError(ep.url, f"/step answered {e}") from None
        except EnvError:
            self.stats["episode_errors"] += 1
            raise
        ep.steps += 1
        self.stats["steps"] += 1
        return result

    async def close(self, ep: EnvEpisode) -> None:
        """Ends the episode (a no-op on the server when it already ended); never raises."""
        if ep.url in self.open and self.open[ep.url] > 0:
            self.open[ep.url] -= 1
        await self._close_quietly(ep.url, ep.id)

    def abandon(self, ep: EnvEpisode) -> None:
        """`close` without waiting (a cancelled trajectory may not await): the close runs in the
        background; the server's reaper (--episode-ttl-s) covers it if the loop stops first."""
        if ep.url in self.open and self.open[ep.url] > 0:
            self.open[ep.url] -= 1
        self._background(self._close_quietly(ep.url, ep.id))

    def _background(self, coro) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:  # no running loop: nothing to close with
            coro.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _close_quietly(self, url: str, eid: str) -> None:
        try:
            await self._post(url, "/close", {"episode_id": eid})
        except EnvError:
            pass  # the server is gone: so is the episode
