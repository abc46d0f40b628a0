"""HTTP plumbing shared by the generation client and the admin client.

Both talk to the same SGLang-protocol servers with the same error model, so the session, the
per-call deadline and the mapping of failures live here once:

    4xx                                   -> ServerRequestError (retrying the same call cannot help)
    connection error, timeout, 5xx        -> Transient          (worth retrying, maybe elsewhere)
    {"success": false, ...} on an admin   -> reported per server by AdminError (admin.py)
"""
from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from typing import Any, Optional

import aiohttp

from megarl.common.net import normalize_address


class RolloutError(RuntimeError):
    """Generation could not complete (no healthy server, retries exhausted)."""


class ServerRequestError(RolloutError):
    """A server rejected a request (4xx); retrying the same request cannot help."""

    def __init__(self, address: str, status: int, message: str):
        super().__init__(f"{address}: HTTP {status}: {message}")
        self.address, self.status, self.message = address, status, message


class AdminError(RolloutError):
    """An admin call failed on some servers: {address: reason}."""

    def __init__(self, path: str, failures: dict[str, str]):
        detail = "; ".join(f"{a}: {r}" for a, r in failures.items())
        super().__init__(f"{path} failed on {len(failures)} server(s): {detail}")
        self.path, self.failures = path, failures


class Transient(Exception):
    """Connection error, timeout or 5xx: worth retrying elsewhere."""


@dataclass(eq=False)
class Server:
    """One server as a client sees it. ``index`` is its position in the client's list (the
    weight-update group rank of server i is 1 + i)."""

    address: str
    index: int
    inflight: int = 0
    failures: int = 0
    alive: bool = True
    removed: bool = False  # dropped by the server set's owner (RolloutCluster): never picked again
    probe: Optional[asyncio.Task] = field(default=None, repr=False)
    calls: set = field(default_factory=set, repr=False)  # in-flight /generate calls (tasks)


class HttpClient:
    """A pool of servers behind one aiohttp session (created lazily on the running loop, since a
    session is bound to the loop that made it). Use from one event loop; ``close()`` when done."""

    def __init__(self, addresses: list[str], api_key: Optional[str] = None, connect_timeout: float = 5.0):
        if not addresses:
            raise ValueError(f"{type(self).__name__} needs at least one server address")
        self.servers = [Server(normalize_address(a), i) for i, a in enumerate(addresses)]
        self.api_key, self.connect_timeout = api_key, connect_timeout
        self._session: Optional[aiohttp.ClientSession] = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for s in self.servers:
            if s.probe is not None:
                s.probe.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            # limit=0: one connection per in-flight request; the servers do their own batching
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=headers)
        return self._session

    async def _call(self, srv: Server, method: str, path: str, body: Any, timeout: float) -> Any:
        """One HTTP call. 4xx -> ServerRequestError; network/timeout/5xx -> Transient."""
        t = aiohttp.ClientTimeout(total=timeout, sock_connect=self.connect_timeout)
        try:
            async with self._http().request(method, srv.address + path, json=body, timeout=t) as r:
                text = await r.text()
                # 5xx: the server's trouble (overloaded, restarting), another server may answer; 4xx: the request's
                if r.status >= 500:
                    raise Transient(f"HTTP {r.status}: {text[:300]}")
                data = _json_or_text(text, r.content_type)
                if r.status >= 400:
                    msg = data.get("message", text) if isinstance(data, dict) else text
                    # 500 characters: enough for the server's one-line reason, bounded for logs and failure records
                    raise ServerRequestError(srv.address, r.status, str(msg)[:500])
                return data
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
            raise Transient(f"{type(e).__name__}: {e}") from e


def backoff_delay(attempt: int, base: float, cap: float) -> float:
    """Exponential back-off with jitter in [d/2, d] so retrying clients do not synchronise."""
    d = min(cap, base * (2 ** attempt))
    return d * (0.5 + random.random() / 2)


def _json_or_text(text: str, content_type: str) -> Any:
    # some servers send JSON without the content type: the first character decides
    if content_type == "application/json" or text[:1] in ("{", "["):
        try:
            return json.loads(text)
        except ValueError:
            return text
    return text
