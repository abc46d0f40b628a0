"""What the rollout servers are, asked before anything depends on it: `check_servers` waits for
each server of ``rollout.servers`` to answer ``/health`` and reads what its ``/model_info`` says it
is; `check_wire` turns that into the weight wire every server can take
(`megarl.config.server_wire.resolve_wire`). megarl-train's preflight runs both before any rank
starts; a rollout manager run apart runs `check_wire` on its own config (a config megarl-train
saved is resolved already). Standard library only (and `megarl.protocol.wire`): no torch.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from megarl.common.errors import ConfigError


def check_wire(cfg) -> None:
    """The servers say what they are (``rollout.servers``: their /model_info; the servers the job
    starts: by ``rollout.engine``), and ``cfg.weights`` becomes the wire they can all take
    (`megarl.config.server_wire.resolve_wire`: auto resolved, an impossible setting refused).
    Rank 0 saves the resolved config, which the rollout manager reads."""
    from megarl.config.server_wire import local_extensions, resolve_wire

    if cfg.rollout.servers:
        servers = check_servers(cfg.rollout.servers, cfg.rollout.api_key or None,
                                cfg.rollout.health_timeout_s)
    else:
        servers = {f"(local {cfg.rollout.engine} server)": local_extensions(cfg.rollout.engine)}
    cfg.weights = resolve_wire(cfg.weights, servers, cfg.rollout.partial_rollout, cfg.lora.enabled)


HEALTH_WAIT_CAP_S = 3600.0  # the longest preflight waits for a server, whatever the config says
PROGRESS_FIRST_S = 5.0  # first "still waiting" line; then every doubling, at most a minute apart


def check_servers(servers: list[str], api_key, timeout_s: float) -> dict[str, frozenset]:
    """{url: the extensions it advertises (`megarl.protocol.wire.server_extensions`)}, once every server
    answered ``/health`` with 200 and ``/model_info`` with a JSON object before
    one shared deadline: rollout.health_timeout_s, at most ``HEALTH_WAIT_CAP_S``. Servers that
    are still starting are retried until the deadline, with a progress line on stdout every
    5, 10, 20, 40, 60, 60 ... s; a server that answers but wrongly (HTTP 5xx, not JSON) fails at once."""
    from megarl.rollout.http import normalize_address
    from megarl.protocol.wire import server_extensions

    found: dict[str, frozenset] = {}
    wait = min(timeout_s, HEALTH_WAIT_CAP_S)
    limit = (f"rollout.health_timeout_s={timeout_s:g} s" if wait == timeout_s else
             f"{wait:g} s (rollout.health_timeout_s={timeout_s:g}, capped at {HEALTH_WAIT_CAP_S:g} s)")
    t0 = time.monotonic()
    deadline = t0 + wait
    for i, address in enumerate(servers):
        url = normalize_address(address)
        field = f"rollout.servers[{i}]"
        _wait_health(field, url, t0, deadline, limit)
        try:
            status, body = _get(url + "/model_info", api_key, max(1.0, deadline - time.monotonic()))
        except OSError as e:
            raise ConfigError(f"{field}: {url}/model_info failed: {e}") from None
        if status == 401:
            raise ConfigError(f"{field}: {url}/model_info answered HTTP 401: check rollout.api_key")
        if status != 200:
            raise ConfigError(f"{field}: {url}/model_info answered HTTP {status}")
        try:
            info = json.loads(body)
        except ValueError:
            info = None
        if not isinstance(info, dict):
            raise ConfigError(f"{field}: {url}/model_info did not answer a JSON object: {body[:60]!r}")
        try:
            found[url] = server_extensions(info)
        except ValueError as e:
            raise ConfigError(f"{field}: {url}{e}") from None
    return found


def _wait_health(field: str, url: str, t0: float, deadline: float, limit: str) -> None:
    """Polls ``url``/health every 0.5 s until it answers 200 (returns), answers anything else
    (raises) or the deadline passes (raises); says on stdout that it is still waiting."""
    last, report = None, PROGRESS_FIRST_S
    while True:
        left = deadline - time.monotonic()
        try:
            status, _ = _get(url + "/health", None, max(0.1, min(5.0, left)))
        except OSError as e:  # refused, unreachable, timed out: maybe not up yet
            last = f"{type(e).__name__}: {getattr(e, 'reason', None) or e}"
        else:
            if status != 200:
                raise ConfigError(f"{field}: {url}/health answered HTTP {status}")
            return
        now = time.monotonic()
        if now + 0.5 > deadline:
            raise ConfigError(f"{field}: {url} did not answer /health within {limit} ({last})")
        if now - t0 >= report:
            print(f"[megarl] preflight: waiting for {field} {url}/health: {now - t0:.0f} s of "
                  f"{deadline - t0:.0f} s ({last})", flush=True)
            report = min(report * 2, report + 60.0)
        time.sleep(0.5)


# No proxies from the environment: the rollout client (aiohttp) does not use them either.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str, api_key, timeout: float) -> tuple[int, str]:
    req = urllib.request.Request(url, method="GET")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            return r.status, r.read(1 << 20).decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read(1 << 20).decode("utf-8", "replace")
