"""megarl-env: an environment class served over HTTP (the protocol in `megarl.envs.types`).

    megarl-env pkg.module:Class [--args JSON] [--host 127.0.0.1] [--port N]
               [--api-key-file FILE] [--max-episodes 256] [--step-timeout-s 30] [--episode-ttl-s 600]

Many episodes per process, each its own ``Class(**args)`` instance, stepped concurrently (coroutines
on the loop, plain methods in worker threads). One episode's failure ends that episode only:

    environment raised in reset/step   -> 500, the episode is closed and counted failed
    reset/step over --step-timeout-s   -> 504, likewise (a coroutine is cancelled; a plain method's
                                          thread cannot be killed: it finishes in the background,
                                          and the instance is closed after it - close never races
                                          step. With half the --threads held so, /health answers 503
                                          and the job's watcher restarts the server. Put code
                                          execution in the sandbox, which has its own time limit)
    unknown episode_id                 -> 404   (closed, finished, or reaped after --episode-ttl-s idle)
    --max-episodes open                -> 503   (the client retries later or elsewhere)
    /close of a stepping episode       -> the id ends at once, the instance closes after the step
    malformed body                     -> 400 naming the field
    no / wrong key (with a key)        -> 401 on every route but /health

A finished episode (done) is closed by the server. Security defaults as megarl-server's: binds
127.0.0.1; the key comes from a file (owner-only) or the launcher's pipe, never argv; a non-loopback
bind without a key is refused.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import inspect
import json
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

from aiohttp import web

from megarl.envs.base import call_maybe_async, load_environment
from megarl.envs.types import (ProtocolError, ResetResult, StepResult, parse_reset_request, parse_step_request,
                               parse_step_result)

log = logging.getLogger("megarl.env")

OPEN_PATHS = frozenset({"/health"})
_LOOPBACKS = ("127.0.0.1", "localhost", "::1")


@dataclass
class Episode:
    env: Any
    started: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    steps: int = 0
    busy: bool = False  # a step is running: a second concurrent step on one episode is refused
    running: Optional[asyncio.Future] = None  # the environment's call in progress (reset/step)


class EnvState:
    def __init__(self, cls: type, args: dict, name: str, api_key: Optional[str] = None, max_episodes: int = 256,
                 step_timeout_s: float = 30.0, episode_ttl_s: float = 600.0, tools: Optional[list] = None,
                 threads: Optional[int] = None):
        self.cls, self.args, self.name, self.api_key = cls, args, name, api_key
        self.threads = threads or max_episodes  # one worker per open episode: none waits for another's
        self._tools = list(tools if tools is not None else getattr(cls, "tools", []) or [])
        self.max_episodes, self.step_timeout_s, self.episode_ttl_s = max_episodes, step_timeout_s, episode_ttl_s
        self.episodes: dict[str, Episode] = {}
        self.stuck = 0  # plain calls past their deadline whose threads still run (they cannot be killed)
        self.background: set[asyncio.Task] = set()  # closes of ended episodes
        self.stats = {"episodes_started": 0, "episodes_done": 0, "episodes_failed": 0, "episodes_closed": 0,
                      "episodes_reaped": 0, "steps": 0, "step_seconds": 0.0, "rejected_full": 0, "timeouts": 0}

    def tools(self) -> list[dict]:
        return list(self._tools)

    @property
    def wedged(self) -> bool:
        """Half the worker threads hold calls past their deadline: the server cannot keep its
        promises, and /health says so (the job's watcher then restarts it)."""
        return self.stuck >= max(1, self.threads // 2)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"object": "error", "message": message, "code": status}, status=status)


@web.middleware
async def _guard(request: web.Request, handler):
    state: EnvState = request.app["state"]
    if state.api_key and request.path not in OPEN_PATHS:
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, f"Bearer {state.api_key}".encode()):
            return _error(401, "missing or invalid API key (Authorization: Bearer KEY)")
    try:
        return await handler(request)
    except ProtocolError as e:
        return _error(400, str(e))
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - keep serving the other episodes
        log.exception("%s failed", request.path)
        return _error(500, f"{type(e).__name__}: {e}")


async def _body(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ProtocolError(f"{request.path}: body is not JSON") from None


def _close_env(state: EnvState, eid: str, why: str) -> None:
    """Ends episode `eid` (counted as `why`) at once: its id is gone; its instance is closed in the
    background once the call it may still be running has returned (close never races step)."""
    ep = state.episodes.pop(eid, None)
    if ep is None:
        return
    state.stats[f"episodes_{why}"] += 1

    async def close():
        if ep.running is not None and not ep.running.done():
            await asyncio.wait([ep.running])
        try:
            await asyncio.wait_for(call_maybe_async(ep.env.close), state.step_timeout_s)
        except Exception as e:  # noqa: BLE001 - a failing close ends nothing else
            log.warning("episode %s: close raised %s: %s", eid, type(e).__name__, e)

    task = asyncio.get_running_loop().create_task(close())
    state.background.add(task)
    task.add_done_callback(state.background.discard)


async def _run(state: EnvState, eid: str, ep: Episode, what: str, fn, *args):
    """The environment's call under the step deadline; a raise or a timeout ends the episode. A
    coroutine past its deadline is cancelled; a plain method's thread cannot be, so it is counted
    (`EnvState.stuck`) until it returns."""
    ep.running = call = asyncio.ensure_future(call_maybe_async(fn, *args))
    try:
        return await asyncio.wait_for(asyncio.shield(call), state.step_timeout_s), None
    except asyncio.TimeoutError:
        state.stats["timeouts"] += 1
        if inspect.iscoroutinefunction(fn):
            call.cancel()
        else:
            state.stuck += 1

            def returned(_):
                state.stuck -= 1
            call.add_done_callback(returned)
        _close_env(state, eid, "failed")
        return None, _error(504, f"episode {eid}: {what} took over {state.step_timeout_s} s; episode ended")
    except Exception as e:  # noqa: BLE001 - the environment's fault: this episode ends, the server serves on
        log.warning("episode %s: %s raised %s: %s", eid, what, type(e).__name__, e)
        _close_env(state, eid, "failed")
        return None, _error(500, f"episode {eid}: {what} raised {type(e).__name__}: {e}; episode ended")


async def reset(request: web.Request) -> web.Response:
    state: EnvState = request.app["state"]
    eid, task, seed = parse_reset_request(await _body(request))
    if eid in state.episodes:
        return _error(409, f"episode {eid} is already open")
    if len(state.episodes) >= state.max_episodes:
        state.stats["rejected_full"] += 1
        return _error(503, f"{state.max_episodes} episodes open (--max-episodes); retry later")
    state.episodes[eid] = ep = Episode(None, busy=True)  # the slot is taken while the instance is built
    state.stats["episodes_started"] += 1
    try:  # in a worker thread: a slow __init__ holds only this episode
        ep.env = await asyncio.wait_for(asyncio.to_thread(lambda: state.cls(**state.args)), state.step_timeout_s)
    except Exception as e:  # noqa: BLE001 - the environment's fault, this episode's only
        state.episodes.pop(eid, None)
        state.stats["episodes_failed"] += 1
        return _error(500, f"episode {eid}: {state.name}(**args) raised {type(e).__name__}: {e}")
    out, err = await _run(state, eid, ep, "reset", ep.env.reset, task, seed)
    ep.busy, ep.last_used = False, time.monotonic()
    if err is not None:
        return err
    if out is None:
        out = ResetResult()
    elif isinstance(out, dict):
        out = ResetResult(info=out)
    if not isinstance(out, ResetResult):
        _close_env(state, eid, "failed")
        return _error(500, f"episode {eid}: reset returned {type(out).__name__}, not ResetResult, dict or None")
    return web.json_response(out.to_json())


async def step(request: web.Request) -> web.Response:
    state: EnvState = request.app["state"]
    eid, action = parse_step_request(await _body(request))
    ep = state.episodes.get(eid)
    if ep is None:
        return _error(404, f"no open episode {eid} (never reset, done, closed or reaped)")
    if ep.busy:
        return _error(409, f"episode {eid} is already stepping")
    ep.busy = True
    t0 = time.perf_counter()
    out, err = await _run(state, eid, ep, "step", ep.env.step, action)
    ep.busy, ep.last_used = False, time.monotonic()
    state.stats["steps"] += 1
    state.stats["step_seconds"] += time.perf_counter() - t0
    if err is not None:
        return err
    if not isinstance(out, StepResult):
        _close_env(state, eid, "failed")
        return _error(500, f"episode {eid}: step returned {type(out).__name__}, not StepResult; episode ended")
    ep.steps += 1
    try:
        body = out.to_json()
        parse_step_result(body)  # what the client would refuse is the environment's fault, said here
        json.dumps(body, allow_nan=False)
    except (TypeError, ValueError) as e:  # ProtocolError is a ValueError
        _close_env(state, eid, "failed")
        return _error(500, f"episode {eid}: bad step result ({e}); episode ended")
    if out.done:
        _close_env(state, eid, "done")
    return web.json_response(body)


async def close(request: web.Request) -> web.Response:
    state: EnvState = request.app["state"]
    body = await _body(request)
    eid = body.get("episode_id") if isinstance(body, dict) else None
    if not isinstance(eid, str):
        raise ProtocolError("close.episode_id: missing")
    known = eid in state.episodes
    _close_env(state, eid, "closed")  # a step still running finishes first, then the instance is closed
    return web.json_response({"closed": known})


async def health(request: web.Request) -> web.Response:
    state: EnvState = request.app["state"]
    if state.wedged:
        return _error(503, f"{state.stuck} environment calls are still running past their deadline "
                           f"(of {state.threads} worker threads)")
    return web.json_response({"ok": True})


async def info(request: web.Request) -> web.Response:
    state: EnvState = request.app["state"]
    return web.json_response({"env": state.name, "tools": state.tools(), "max_episodes": state.max_episodes,
                              "step_timeout_s": state.step_timeout_s})


async def stats(request: web.Request) -> web.Response:
    state: EnvState = request.app["state"]
    return web.json_response({**state.stats, "episodes_open": len(state.episodes), "stuck": state.stuck})


async def _reaper(app: web.Application) -> None:
    state: EnvState = app["state"]
    while True:
        await asyncio.sleep(max(0.05, min(30.0, state.episode_ttl_s / 4)))
        now = time.monotonic()
        for eid, ep in list(state.episodes.items()):
            if not ep.busy and now - ep.last_used > state.episode_ttl_s:
                log.info("episode %s idle for %.0f s: closed", eid, now - ep.last_used)
                _close_env(state, eid, "reaped")


async def _start_reaper(app: web.Application):
    loop = asyncio.get_running_loop()
    # plain (blocking) environment methods run in these threads: one per open episode, up to --threads
    loop.set_default_executor(ThreadPoolExecutor(max_workers=app["state"].threads, thread_name_prefix="env"))
    task = loop.create_task(_reaper(app))
    yield
    task.cancel()
    state: EnvState = app["state"]
    for eid in list(state.episodes):
        _close_env(state, eid, "closed")
    if state.background:
        await asyncio.wait(list(state.background), timeout=state.step_timeout_s)


def build_app(state: EnvState) -> web.Application:
    app = web.Application(middlewares=[_guard], client_max_size=16 * 2**20)
    app["state"] = state
    app.router.add_post("/reset", reset)
    app.router.add_post("/step", step)
    app.router.add_post("/close", close)
    app.router.add_get("/health", health)
    app.router.add_get("/info", info)
    app.router.add_get("/stats", stats)
    app.cleanup_ctx.append(_start_reaper)
    return app


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megarl-env", description="Serve an environment class over HTTP "
                                "(reset / step / close; docs/environments.md).")
    p.add_argument("env", help="the environment class, package.module:Class")
    p.add_argument("--args", default="{}", help="keyword arguments of the class, a JSON object")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=0, help="port (0: one the kernel picks, logged)")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="file holding the key every route but /health requires (owner-only)")
    p.add_argument("--api-key-fd", type=int, default=None, help=argparse.SUPPRESS)  # a pipe from the launcher
    p.add_argument("--max-episodes", type=int, default=256, help="episodes open at once (503 beyond)")
    p.add_argument("--step-timeout-s", type=float, default=30.0, help="deadline of one reset or step")
    p.add_argument("--episode-ttl-s", type=float, default=600.0, help="an idle episode is closed after this")
    p.add_argument("--threads", type=int, default=None,
                   help="worker threads for plain (blocking) environment methods (default: --max-episodes)")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from megarl.common.net import http_url
    from megarl.protocol import handshake

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.max_episodes < 1 or (args.threads or 1) < 1 or args.step_timeout_s <= 0 or args.episode_ttl_s <= 0:
            raise ValueError("--max-episodes and --threads must be >= 1, --step-timeout-s and --episode-ttl-s > 0")
        env_args = json.loads(args.args)
        if not isinstance(env_args, dict):
            raise ValueError(f"--args: expected a JSON object, got {args.args!r}")
        cls = load_environment(args.env)
        key = None
        if args.api_key_file is not None:
            key = handshake.read_secret_file(args.api_key_file, "--api-key-file").decode()
        elif args.api_key_fd is not None:
            key = handshake.read_secret_fd(args.api_key_fd, "--api-key-fd").decode()
        if args.host not in _LOOPBACKS and not key:
            raise ValueError(f"--host {args.host}: a non-loopback bind needs --api-key-file "
                             "(anyone who can reach it could drive the run's episodes)")
        tools = probe_tools(cls, env_args, args.env)
    except (ValueError, json.JSONDecodeError, UnicodeDecodeError) as e:
        print(f"megarl-env: error: {e}", file=sys.stderr)
        return 2
    state = EnvState(cls, env_args, args.env, key, args.max_episodes, args.step_timeout_s, args.episode_ttl_s,
                     tools, args.threads)
    return _serve(state, args.host, args.port, http_url)


def probe_tools(cls: type, env_args: dict, name: str) -> list[dict]:
    """One instance built before serving: bad --args fail at start in one line, not at the first
    episode; its ``tools`` (an instance may build them from its args) are what /info lists."""
    try:
        env = cls(**env_args)
    except Exception as e:  # noqa: BLE001 - any failure of the user's class is a start-up error
        raise ValueError(f"{name}(**{json.dumps(env_args)}): {type(e).__name__}: {e}") from None
    tools = list(getattr(env, "tools", []) or [])
    try:
        json.dumps(tools)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}.tools: not JSON ({e})") from None
    try:
        asyncio.run(call_maybe_async(env.close))
    except Exception:  # noqa: BLE001 - the probe's close is a courtesy
        pass
    return tools


def _serve(state: EnvState, host: str, port: int, http_url) -> int:
    async def run():
        runner = web.AppRunner(build_app(state), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as e:
            print(f"megarl-env: error: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
            await runner.cleanup()
            return 2
        bound = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - the port --port 0 got
        log.info("megarl-env ready on %s (%s)", http_url(host, bound), state.name)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()
        return 0

    try:
        return asyncio.run(run())
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
