"""Test instrumentation for the real-SGLang tier: on PYTHONPATH of a `megarl-train` run whose local
servers are SGLang, it records the JSON body fields that SGLang's access log does not show (the
``load_format`` of every weight update) as SGLang's own HTTP app receives them.

Active only with MEGARL_TEST_RECORD_DIR set, and only in a process that imports SGLang's HTTP
server module: there an ASGI middleware is added to its FastAPI app, which appends one JSON line
per POST {"path", "load_format"} to $MEGARL_TEST_RECORD_DIR/received-<pid>.jsonl. It reads the
request as it streams past and changes nothing in it.
"""
import importlib.abc
import importlib.machinery
import json
import os
import sys

TARGET = "sglang.srt.entrypoints.http_server"
OUT = os.environ.get("MEGARL_TEST_RECORD_DIR")


class _Recorder:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        chunks = []

        async def tee():
            msg = await receive()
            if msg.get("type") == "http.request":
                chunks.append(msg.get("body", b""))
                if not msg.get("more_body"):
                    _write(scope["path"], b"".join(chunks))
            return msg

        return await self.app(scope, tee, send)


def _write(path: str, body: bytes) -> None:
    fmt = None
    if "weights" in path:
        try:
            fmt = json.loads(body or b"{}").get("load_format")
        except (ValueError, AttributeError):
            fmt = "<unparsed>"
    with open(os.path.join(OUT, f"received-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps({"path": path, "load_format": fmt}) + "\n")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.app.add_middleware(_Recorder)

        spec.loader.exec_module = exec_module
        return spec


if OUT:
    sys.meta_path.insert(0, _Finder())
