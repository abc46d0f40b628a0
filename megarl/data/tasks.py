"""Synthetic tasks with programmatic verifiers: multi-digit addition ("12+34=" -> "46").

The CPU demo and the RL benchmarks train on it: `write_addition_corpus` emits SFT pairs, RL prompts
and a held-out eval set that never shares a pair with the other two, all fixed by (digits, seed).
`evaluate_accuracy` measures greedy accuracy of an HF model dir through a rollout server speaking
SGLang's /generate (megarl's CPU server is started for it when no URL is given).
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Iterable, Iterator

from megarl.data.datasets import PromptDataset
from megarl.data.tokenizer import load_tokenizer
from megarl.rollout.rewards import arith_exact_match

__all__ = [
    "AdditionTask",
    "write_jsonl",
    "write_addition_corpus",
    "evaluate_accuracy",
    "rollout_server",
]

_EVAL_STREAM, _SFT_STREAM, _RL_STREAM = 0, 1, 2


@dataclass(frozen=True)
class AdditionTask:
    """a + b with both operands of exactly `digits` digits (0-9 for digits=1)."""

    digits: int = 2
    seed: int = 0

    def __post_init__(self):
        if self.digits < 1:
            raise ValueError(f"digits must be >= 1, got {self.digits}")

    @property
    def low(self) -> int:
        return 0 if self.digits == 1 else 10 ** (self.digits - 1)

    @property
    def num_pairs(self) -> int:
        return (10 ** self.digits - self.low) ** 2

    def pair(self, k: int) -> tuple[int, int]:
        """The k-th (a, b) in row-major order over the operand range."""
        a, b = divmod(k, 10 ** self.digits - self.low)
        return a + self.low, b + self.low

    @staticmethod
    def prompt(a: int, b: int) -> str:
        return f"{a}+{b}="

    @staticmethod
    def answer(a: int, b: int) -> str:
        return str(a + b)

    def _rng(self, stream: int) -> random.Random:
        return random.Random(self.seed * 1_000_003 + stream)

    def held_out(self, n: int) -> list[tuple[int, int]]:
        """n distinct pairs, the same for a given (digits, seed) whatever else is generated."""
        if n > self.num_pairs:
            raise ValueError(f"{n} held-out pairs requested; only {self.num_pairs} exist")
        return [self.pair(k) for k in self._rng(_EVAL_STREAM).sample(range(self.num_pairs), n)]

    def training_pairs(self, n: int, n_held_out: int, stream: int = _SFT_STREAM) -> list[tuple[int, int]]:
        """n pairs drawn with replacement from those NOT in `held_out(n_held_out)`."""
        excluded = set(self.held_out(n_held_out))
        if len(excluded) >= self.num_pairs and n > 0:
            raise ValueError("the held-out set covers every pair; nothing is left to train on")
        rng, out = self._rng(stream), []
        while len(out) < n:
            p = self.pair(rng.randrange(self.num_pairs))
            if p not in excluded:
                out.append(p)
        return out

    def sft_rows(self, pairs: Iterable[tuple[int, int]]) -> Iterator[dict]:
        return ({"prompt": self.prompt(a, b), "response": self.answer(a, b)} for a, b in pairs)

    def rl_rows(self, pairs: Iterable[tuple[int, int]]) -> Iterator[dict]:
        return ({"prompt": self.prompt(a, b), "answer": self.answer(a, b)} for a, b in pairs)


def write_jsonl(path: str, rows: Iterable[dict]) -> int:
    """Write one JSON object per line; returns the number written."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
            n += 1
    return n


def write_addition_corpus(
    out_dir: str, digits: int = 2, n_sft: int = 5000, n_rl: int = 5000, n_eval: int = 500, seed: int = 0
) -> dict[str, str]:
    """sft.jsonl {"prompt","response"}, rl_prompts.jsonl and eval_prompts.jsonl {"prompt","answer"}."""
    task = AdditionTask(digits, seed)
    paths = {name: os.path.join(out_dir, f"{name}.jsonl") for name in ("sft", "rl_prompts", "eval_prompts")}
    write_jsonl(paths["sft"], task.sft_rows(task.training_pairs(n_sft, n_eval, _SFT_STREAM)))
    write_jsonl(paths["rl_prompts"], task.rl_rows(task.training_pairs(n_rl, n_eval, _RL_STREAM)))
    write_jsonl(paths["eval_prompts"], task.rl_rows(task.held_out(n_eval)))
    return paths


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http_json(url: str, payload: dict | None = None, timeout: float = 60.0):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = resp.read()
    return json.loads(body) if body else None


@contextlib.contextmanager
def rollout_server(model_dir: str, port: int | None = None, ready_timeout: float = 120.0) -> Iterator[str]:
    """Start `python -m megarl.rollout.server --model DIR`, wait for GET /health, yield its URL.

    The server's output goes to a temp log whose tail is in the error if it dies or never gets ready.
    """
    port = port or _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", prefix="megarl-server-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "megarl.rollout.server", "--model", model_dir, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"rollout server exited with {proc.returncode}: {_tail(log.name)}")
            try:
                _http_json(url + "/health", timeout=2.0)
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rollout server not ready after {ready_timeout}s: {_tail(log.name)}")
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(log.name)


def _tail(path: str, n: int = 2000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-n:]


def evaluate_accuracy(
    model_dir: str,
    prompts_path: str,
    n: int = 500,
    server_url: str | None = None,
    max_new_tokens: int = 8,
    batch_size: int = 64,
) -> float:
    """Greedy exact-match accuracy on the first n prompts of a {"prompt","answer"} JSONL.

    Generation goes through SGLang's /generate (temperature 0, stop at EOS) at `server_url`, or at a
    megarl CPU server started on `model_dir` for the call. Scored by `arith_exact_match` on the
    completion decoded up to its first EOS.
    """
    tokenizer = load_tokenizer(model_dir)
    samples = PromptDataset(prompts_path, tokenizer).samples[:n]
    if not samples:
        raise ValueError(f"no prompts in {prompts_path}")
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "stop_token_ids": [tokenizer.eos_id]}
    with contextlib.ExitStack() as stack:
        url = server_url or stack.enter_context(rollout_server(model_dir))
        correct = 0.0
        for start in range(0, len(samples), batch_size):
            batch = samples[start:start + batch_size]
            outs = _http_json(url + "/generate", {"input_ids": [s.prompt_ids for s in batch],
                                                  "sampling_params": params}, timeout=600.0)
            for s, out in zip(batch, outs):
                ids = list(out["output_ids"])
                if tokenizer.eos_id in ids:
                    ids = ids[: ids.index(tokenizer.eos_id)]
                correct += arith_exact_match(s.prompt, tokenizer.decode(ids), s.meta)
    return correct / len(samples)
