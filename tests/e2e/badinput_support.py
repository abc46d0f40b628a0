"""Inputs for the bad-input corpus (test_bad_input.py) and the security tests (test_security.py):
a directory of broken models, tokenizers and datasets built from the tiny demo model, misbehaving
HTTP servers, and two runners of the console entry points: in-process (`run_in_process`, for a
case refused before any work: `main(argv)` under inprocess_cli's guards) and as a real
subprocess (`run_cli`, for a case that waits on the network or starts a server, and one case of
each entry point so the console path itself stays covered).

Each corpus CLI case is a `CliCase`: argv with ``{name}`` placeholders filled from `World.paths`,
the exact exit status, substrings the one error line must contain, paths that must not exist
afterwards (no half-written output) and inputs that must still exist (nothing clobbered).
"""
from __future__ import annotations

import http.server
import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "examples", "tiny")
MODULES = {"megarl-train": "megarl.train", "megarl-convert": "megarl.commands.convert",
           "megarl-logprobs": "megarl.commands.logprobs", "megarl-server": "megarl.server",
           "megarl-launch": "megarl.launch.plan", "megarl-rollout-manager": "megarl.rollout.manager"}
MAINS = {"megarl-train": "megarl.train:main", "megarl-convert": "megarl.commands.convert:main",  # setup.py's
         "megarl-logprobs": "megarl.commands.logprobs:main", "megarl-server": "megarl.server.__main__:main",
         "megarl-launch": "megarl.launch.plan:main", "megarl-rollout-manager": "megarl.rollout.manager:main"}


@dataclass(frozen=True)
class CliCase:
    id: str
    prog: str  # a key of MODULES
    args: tuple[str, ...]
    rc: int
    needles: tuple[str, ...]
    absent: tuple[str, ...] = ()  # paths (placeholders allowed) that must not exist afterwards
    doc: str = ""  # what the product does, for docs/reliability.md
    present: tuple[str, ...] = ()  # inputs that must still exist afterwards (not clobbered)


@dataclass
class CliResult:
    rc: int | None
    stdout: str
    stderr: str
    wall_s: float
    leaks: tuple[str, ...] = ()  # in-process only: what the call left in this process (inprocess_cli)


def cli_env() -> dict:
    """The environment of an entry point run by a test: one thread, this checkout, no launcher."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    return env


def run_cli(prog: str, argv: list[str], cwd: str, timeout: float = 300.0) -> CliResult:
    """One real entry point as a subprocess (``python -m``, what the console script calls).
    ``timeout`` is the generous "no hang" bound; a run past it is a failed case (rc None)."""
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", MODULES[prog], *argv], capture_output=True, text=True,
                              cwd=cwd, env=cli_env(), timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return CliResult(None, str(e.stdout or ""), f"HUNG: no exit within {timeout:g} s", timeout)
    return CliResult(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0)


def run_in_process(prog: str, argv: list[str], cwd: str, timeout: float = 300.0) -> CliResult:
    """The entry point's ``main(argv)`` in this process, as `run_cli` would run it (same argv,
    cwd, environment, captured output, exit status and timeout); ``leaks`` names what it left in
    this process or a work step it reached (inprocess_cli). For cases refused before any work."""
    from inprocess_cli import call_main

    module, fn = MAINS[prog].split(":")
    main = getattr(importlib.import_module(module), fn)
    out = call_main(main, argv, sys.modules[module].__file__, cwd, cli_env(), timeout)
    return CliResult(out.rc, out.stdout, out.stderr, out.wall_s, out.leaks)


# ----------------------------------------------------------------------------- misbehaving servers

class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict = {}

    def do_GET(self):  # noqa: N802 - http.server's hook
        status, body = self.routes.get(self.path, (404, b"not found"))
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def fake_server(routes: dict[str, tuple[int, bytes]]) -> tuple[str, http.server.HTTPServer]:
    """An HTTP server on loopback answering GET ``path`` with ``(status, body)``."""
    handler = type("H", (_Handler,), {"routes": routes})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{srv.server_address[1]}", srv


def silent_listener() -> socket.socket:
    """A socket that accepts TCP connections (kernel backlog) but never answers: a hung server."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s


def closed_port() -> int:
    from megarl.common.net import free_port

    return free_port()


# ----------------------------------------------------------------------------- broken inputs

def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def _edit_config(d: str, **changes) -> None:
    path = os.path.join(d, "config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump(cfg, open(path, "w"))


def _write(path: str, text) -> str:
    with open(path, "wb" if isinstance(text, bytes) else "w") as f:
        f.write(text)
    return path


def _all_nan(path: str) -> None:
    """Every tensor of a safetensors file NaN: headers, shapes and dtypes stay valid."""
    import torch
    from safetensors.torch import load_file, save_file

    save_file({k: torch.full_like(v, float("nan")) for k, v in load_file(path).items()}, path)


class World:
    """Every broken input of the corpus under one directory; ``paths`` fills the placeholders."""

    def __init__(self, root: str):
        self.root = root
        p = self.paths = {"root": root, "repo": REPO, "sft_yaml": f"{REPO}/configs/tiny_sft.yaml",
                          "grpo_yaml": f"{REPO}/configs/tiny_grpo.yaml", "hf": f"{TINY}/hf",
                          "model": f"{TINY}/model", "sft": f"{TINY}/data/sft.jsonl",
                          "rl": f"{TINY}/data/rl_prompts.jsonl"}
        j = lambda *a: os.path.join(root, *a)  # noqa: E731
        p["bad_json"] = _copy(p["model"], j("bad_json"))
        _write(j("bad_json", "config.json"), "{not json")
        p["gpt2"] = _copy(p["model"], j("gpt2"))
        _edit_config(p["gpt2"], architectures=["GPT2LMHeadModel"])
        p["heads_str"] = _copy(p["hf"], j("heads_str"))
        _edit_config(p["heads_str"], num_attention_heads="four")
        p["trunc"] = _copy(p["model"], j("trunc"))
        st = j("trunc", "model.safetensors")
        _write(st, open(st, "rb").read()[:1000])
        p["big_tok"] = _copy(p["model"], j("big_tok"))
        from megarl.common.tokenizer import train_sentencepiece

        train_sentencepiece(["the quick brown fox jumps over the lazy dog 0123456789+="], p["big_tok"],
                            vocab_size=64, model_type="char")
        p["bad_tok"] = _copy(p["model"], j("bad_tok"))
        _write(j("bad_tok", "tokenizer.model"), b"\x00junk, not a sentencepiece model" * 8)
        p["no_config"] = _copy(p["model"], j("no_config"))
        os.remove(j("no_config", "config.json"))
        p["nan_weights"] = _copy(p["model"], j("nan_weights"))
        _all_nan(j("nan_weights", "model.safetensors"))
        p["vocab_mismatch"] = _copy(p["model"], j("vocab_mismatch"))
        _edit_config(p["vocab_mismatch"], vocab_size=20)
        p["a_file"] = _write(j("a_file"), "x")
        p["bad_yaml"] = _write(j("bad.yaml"), "model: [unclosed\n")
        p["dup_yaml"] = _write(j("dup.yaml"), open(p["grpo_yaml"]).read() + "train:\n  steps: 3\n")
        # another run's directory (its resolved config.yaml), and inputs a conversion must not clobber
        p["other_run"] = j("other_run")
        os.makedirs(p["other_run"])
        _write(j("other_run", "config.yaml"), "train: {run_dir: other_run}\ncheckpoint: {}\nrollout: {}\n")
        p["conv_in"] = _copy(p["model"], j("conv_in"))
        p["conv_parent"] = j("conv_parent")
        _copy(p["model"], j("conv_parent", "model"))
        p["list_yaml"] = _write(j("list.yaml"), "- 1\n- 2\n")
        # datasets
        good = open(p["sft"]).read().splitlines()[:2]
        p["empty"] = _write(j("empty.jsonl"), "\n\n")
        p["bad_line"] = _write(j("bad_line.jsonl"), "\n".join(good + ['{"prompt": "1+2=", "response": ']) + "\n")
        p["not_obj"] = _write(j("not_obj.jsonl"), "[1, 2]\n")
        p["no_key"] = _write(j("no_key.jsonl"), good[0] + "\n" + '{"prompt": "1+1="}\n')
        p["long"] = _write(j("long.jsonl"), good[0] + "\n" + json.dumps({"prompt": "1" * 40, "response": "2",
                                                                         "answer": "2"}) + "\n")
        p["latin1"] = _write(j("latin1.jsonl"), b'{"prompt": "\xff\xfe", "response": "1"}\n')
        p["rl_long"] = _write(j("rl_long.jsonl"), json.dumps({"prompt": "12+" * 15, "answer": "0"}) + "\n")
        # megarl-logprobs inputs
        p["lp_bad_line"] = _write(j("lp_bad_line.jsonl"), '{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2\n')
        p["lp_oov"] = _write(j("lp_oov.jsonl"), '{"input_ids": [1, 2]}\n{"input_ids": [1, 99]}\n')
        p["lp_neg"] = _write(j("lp_neg.jsonl"), '{"input_ids": [1, -1]}\n')
        p["lp_str"] = _write(j("lp_str.jsonl"), '{"input_ids": "1 2 3"}\n')
        p["lp_empty"] = _write(j("lp_empty.jsonl"), "")
        p["lp_long"] = _write(j("lp_long.jsonl"), json.dumps({"input_ids": [1] * 65}) + "\n")
        p["lp_ok"] = _write(j("lp_ok.jsonl"), '{"input_ids": [1, 4, 5]}\n')
        p["nonempty_out"] = j("nonempty_out")
        os.makedirs(p["nonempty_out"])
        _write(j("nonempty_out", "keep.txt"), "x")
        os.makedirs(j("runs"))
        os.makedirs(j("outs"))
        # megarl-rollout-manager: a channel secret (owner-only, and one others can read) and
        # configs naming each
        p["secret"] = _write(j("secret"), "s" * 32)
        os.chmod(p["secret"], 0o600)
        p["open_secret"] = _write(j("open_secret"), "s" * 32)
        os.chmod(p["open_secret"], 0o644)
        p["mgr_yaml"] = _write(j("mgr.yaml"), open(p["grpo_yaml"]).read().replace(
            "rollout:\n", f"rollout:\n  manager_secret_file: {p['secret']}\n", 1))
        p["mgr_open_yaml"] = _write(j("mgr_open.yaml"), open(p["grpo_yaml"]).read().replace(
            "rollout:\n", f"rollout:\n  manager_secret_file: {p['open_secret']}\n", 1))
        # servers: refused, hung, HTTP 500, malformed JSON; a port in use for megarl-server
        self._keep = [silent_listener(), silent_listener()]
        p["refused"] = f"http://127.0.0.1:{closed_port()}"
        p["hung"] = "127.0.0.1:%d" % self._keep[0].getsockname()[1]
        p["busy_port"] = str(self._keep[1].getsockname()[1])
        p["http500"], s1 = fake_server({"/health": (500, b'{"error": "boom"}')})
        p["junk_json"], s2 = fake_server({"/health": (200, b""), "/model_info": (200, b"{not json")})
        self._servers = [s1, s2]

    def fill(self, text: str) -> str:
        return text.format(**self.paths)

    def close(self) -> None:
        for s in self._servers:
            s.shutdown()
        for s in self._keep:
            s.close()


def check_cli_result(case: CliCase, res: CliResult, fill) -> None:
    """What every corpus CLI case promises: the exit status, ONE line ``<prog>: ...`` on stderr
    holding every needle, no traceback, nothing half-written. ``fill`` expands placeholders."""
    import re

    assert not res.leaks, res.leaks  # in-process: refused before any work, the process left as it was
    lines = res.stderr.strip().splitlines()
    assert res.rc == case.rc, (res.rc, res.stderr[-3000:])
    assert len(lines) == 1, res.stderr[-3000:]
    assert re.match(rf"{case.prog}( [a-z-]+)?: ", lines[0]), lines[0]
    assert "Traceback" not in res.stdout + res.stderr
    for needle in case.needles:
        assert fill(needle) in lines[0], lines[0]
    for path in case.absent:  # nothing half-written
        assert not os.path.exists(fill(path.replace("{id}", case.id))), path
    for path in case.present:  # no input clobbered
        assert os.path.exists(fill(path)), path


def run_cases(cases: dict, fill, cwd: str, workers: int = 3, real: dict | None = None) -> dict:
    """Every case of ``cases`` ({key: CliCase}); {key: CliResult}. The keys of ``real`` ({key:
    why}) run as subprocesses, a few at a time; the others in-process, one after another, first
    (nothing else runs meanwhile: they swap this process's cwd, environment and fds). After them
    this process must be as before (inprocess_cli.snapshot), whatever the per-case guards say."""
    import concurrent.futures

    from inprocess_cli import diff, import_guarded, snapshot

    real = real or {}
    assert set(real) <= set(cases), set(real) - set(cases)
    argv = {k: [fill(a.replace("{id}", c.id)) for a in c.args] for k, c in cases.items()}
    import_guarded()
    before = snapshot()
    results = {k: run_in_process(c.prog, argv[k], cwd) for k, c in cases.items() if k not in real}
    left = diff(before, snapshot())
    assert not left, f"the in-process cases changed this process: {left}"
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futs = {k: pool.submit(run_cli, cases[k].prog, argv[k], cwd) for k in real}
        results.update({k: f.result() for k, f in futs.items()})
    return results


def docs_missing(keys) -> list[str]:
    """Case keys docs/reliability.md does not list."""
    text = open(os.path.join(REPO, "docs", "reliability.md")).read()
    return [k for k in keys if f"`{k}`" not in text]


def corpus_tests(cases: dict, real: dict | None = None):
    """What a corpus module of CLI cases repeats, made once: a module fixture running every case
    (``run_cases``, ``real`` as there; it needs the module's ``world`` fixture, ``(root, fill)``),
    one test per case (``check_cli_result``) and the test that docs/reliability.md lists every case.

        results, test_data_case, test_docs_list_every_case = corpus_tests(CASES)

    pytest collects them under the names they are bound to in the module."""
    import pytest

    @pytest.fixture(scope="module")
    def results(world):
        root, fill = world
        return run_cases(cases, fill, root, real=real)

    @pytest.mark.parametrize("key", list(cases))
    def test_case(key, results, world):
        check_cli_result(cases[key], results[key], world[1])

    def test_docs_list_every_case():
        assert not docs_missing(cases), docs_missing(cases)

    return results, test_case, test_docs_list_every_case
