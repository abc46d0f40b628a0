"""Helpers of the rollout-server e2e tests: tiny random HF checkpoints, `megarl-server`
subprocesses on free loopback ports, a tiny HTTP client. Test modules import them from here
(``from e2e_servers import ...``); conftest.py holds only the fixtures (a ``from conftest
import`` would pick whichever tier's conftest pytest loaded last)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "unit"))  # test_server_reference helpers

from test_server_reference import make_tiny_model  # noqa: E402

from megarl.common.net import free_port  # noqa: E402  (tests import it from here)

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello rollout",
          "12+34=46", "pack my box with five dozen liquor jugs"]


class ServerProc:
    """A `python -m megarl.server` child process."""

    def __init__(self, model_dir: str, *args: str, api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "megarl.server", "--model", model_dir,
               "--port", str(self.port), "--log-level", "WARNING", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(cmd, env=env)
        self.t0 = time.monotonic()

    def wait_ready(self, timeout: float = 60.0) -> "ServerProc":
        while time.monotonic() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        self.ready_s = time.monotonic() - self.t0
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"server on {self.url} not ready in {timeout}s")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def make_model_with_tokenizer(path: str, seed: int = 0, **kw) -> dict:
    """Random tiny Llama + a char-level sentencepiece tokenizer (eos id 2)."""
    from megarl.common.tokenizer import train_sentencepiece

    tok = train_sentencepiece(CORPUS, path, vocab_size=64, model_type="char")
    assert tok.vocab_size <= 128
    return make_tiny_model(path, seed=seed, **kw)


API_KEY = "test-key"


def http(method: str, url: str, body=None, key: str | None = None, timeout: float = 60.0):
    """(status, parsed JSON or text) of one request; never raises on HTTP errors."""
    import json
    import urllib.error

    data = body if isinstance(body, bytes) else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


class ForwardingProxy:
    """An HTTP proxy on a free loopback port (own event loop on a daemon thread) that forwards
    every request to ``target`` unchanged; ``on_request(path)`` runs first (count, or kill the
    server mid-protocol). An unreachable target answers 502. Test scaffolding around real
    servers: it never changes what the servers or the trainer say to each other."""

    def __init__(self, target: str, on_request=None):
        import asyncio
        import threading

        self.target, self.on_request = target, on_request or (lambda path: None)
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True).start()
        assert ready.wait(30)

    def _serve(self, ready) -> None:
        import asyncio

        from aiohttp import ClientSession, web

        asyncio.set_event_loop(self.loop)

        async def forward(request: web.Request) -> web.Response:
            self.on_request(request.path)
            try:
                async with self.session.request(request.method, self.target + request.path_qs,
                                                data=await request.read(), headers=request.headers) as r:
                    return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)
            except OSError:
                return web.Response(status=502, text="upstream down")

        async def start():
            self.session = ClientSession()
            app = web.Application(client_max_size=2**30)
            app.router.add_route("*", "/{tail:.*}", forward)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()


def wait_for(cond, what: str, proc, timeout: float = 300.0, err=None, poll_s: float = 0.05):
    """``cond()``'s first truthy value; fails when the job ``proc`` exits first (quoting the end of
    its stderr file ``err`` when given) or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert proc.poll() is None, (f"trainer exited while waiting for {what}: "
                                     f"{err.read_text()[-3000:] if err is not None else ''}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)


def model_version(url: str, key: str | None = None):
    """A server's /model_info weight_version (SGLang says "default" until the first push,
    megarl-server the version it was started with); None while it does not answer. ``key``: a
    run's own servers answer only with the run's key (<run>/servers/api_key)."""
    req = urllib.request.Request(url + "/model_info", headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return json.loads(r.read())["weight_version"]
    except OSError:
        return None
