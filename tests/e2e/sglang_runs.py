"""Helpers of the end-to-end tier against real SGLang (`sglang` marker): `megarl-train` runs of the
tiny demo recipe whose local servers are real SGLang on CPU, fp32, started by megarl-train itself
(``rollout.engine=sglang``), run by tests/harness.py (`train` below).

SGLang is installed into its own venv on first use (tools/sglang_cpu/install.sh, 1-3 min, ~11 GB);
MEGARL_SKIP_SGLANG=1 skips the tier instead.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess

import pytest

import harness

REPO = str(harness.REPO)
DEMO = str(harness.TINY)
MOE = str(harness.TINY_MOE)  # same tokenizer and task as DEMO
RECORDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_recorder")

# Every path SGLang 0.5.x serves that megarl's client and pusher may call.
SGLANG_PATHS = {"/generate", "/model_info", "/get_model_info", "/server_info", "/get_server_info", "/health",
                "/health_generate", "/flush_cache", "/pause_generation", "/continue_generation",
                "/abort_request", "/begin_weight_update", "/end_weight_update", "/init_weights_update_group",
                "/update_weights_from_distributed", "/update_weights_from_disk", "/update_weights_from_tensor",
                "/destroy_weights_update_group", "/update_weight_version", "/get_weights_by_name",
                "/load_lora_adapter", "/unload_lora_adapter"}
MEGARL_ONLY_PATHS = {"/weights_checksum", "/set_threads"}
# uvicorn's access log (SGLang's --log-level-http info): '... "POST /generate HTTP/1.1" 200 OK'
ACCESS = re.compile(r'"(GET|POST|PUT|DELETE) (/[^ ?"]*)[^"]* HTTP/1\.[01]" (\d{3})')


def require_sglang() -> str:
    """The SGLang venv's python (installed on first use), or skip."""
    if os.environ.get("MEGARL_SKIP_SGLANG") == "1":
        pytest.skip("MEGARL_SKIP_SGLANG=1")
    out = subprocess.run(["bash", os.path.join(REPO, "tools", "sglang_cpu", "install.sh")],
                         stdout=subprocess.PIPE, text=True, timeout=1200, check=False)
    assert out.returncode == 0, "tools/sglang_cpu/install.sh failed"
    return out.stdout.strip().splitlines()[-1]


def demo_model(dst: str, src: str = DEMO) -> str:
    """The demo weights (``src``: DEMO or MOE) plus a tokenizer.json with the sentencepiece ids
    (SGLang loads tokenizers with transformers; megarl keeps reading tokenizer.model, found first)."""
    return _hf_tokenizer().hf_model_copy(os.path.join(src, "model"), dst)


def _hf_tokenizer():
    spec = importlib.util.spec_from_file_location(
        "megarl_sglang_cpu_hf_tokenizer", os.path.join(REPO, "tools", "sglang_cpu", "hf_tokenizer.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def overrides(*more: str, server_args=()) -> tuple[str, ...]:
    """The overrides that make megarl-train start SGLang servers itself (``server_args``: more
    SGLang flags), each logging every HTTP request it answers (uvicorn's access log) into
    <run>/servers/serverN.log; then ``more``."""
    return ("rollout.engine=sglang", "rollout.health_timeout_s=400",
            f"rollout.server_args=[{','.join(['--log-level-http', 'info', *server_args])}]", *more)


def run_env(run: str) -> dict:
    """What a run's environment adds to harness.run_env's (one thread per process): the recorder
    (sglang_recorder/sitecustomize.py) on PYTHONPATH, inherited by the SGLang servers: it writes
    the load_format of every weight update they receive under <run>/received/."""
    os.makedirs(os.path.join(run, "received"), exist_ok=True)
    path = os.pathsep.join(p for p in (RECORDER, os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "MEGARL_TEST_RECORD_DIR": os.path.join(run, "received")}


def train(run: str, model: str, *more: str, server_args=(), recipe: str = "tiny_grpo.yaml", timeout: float = 900,
          during=None) -> harness.Run:
    """harness.train of the demo ``recipe`` on ``model`` (demo_model's copy) with the demo's
    held-out prompts (``data.eval_path=`` in ``more`` turns evaluation off) and SGLang servers
    (``overrides``), recorded (``run_env``)."""
    return harness.train(run, *overrides(*more, server_args=server_args), recipe=recipe, model=model,
                         eval_data=f"{DEMO}/data/eval_prompts.jsonl", env=run_env(run), timeout=timeout,
                         during=during)


def load_formats(run: str) -> dict[str, set]:
    """{path: load_formats seen} of the POSTs to a weights endpoint that the servers received."""
    out: dict[str, set] = {}
    d = os.path.join(run, "received")
    for name in os.listdir(d):
        with open(os.path.join(d, name)) as f:
            for line in f:
                row = json.loads(line)
                if "weights" in row["path"]:
                    out.setdefault(row["path"], set()).add(row["load_format"])
    return out


def received(run: str) -> dict[str, dict[str, int]]:
    """{log file: {"METHOD /path STATUS": count}} of every request the run's SGLang servers answered."""
    out = {}
    d = os.path.join(run, "servers")
    for name in sorted(os.listdir(d)):
        if name.endswith(".log"):
            counts: dict[str, int] = {}
            with open(os.path.join(d, name), errors="replace") as f:
                for m in ACCESS.finditer(f.read()):
                    key = f"{m.group(1)} {m.group(2)} {m.group(3)}"
                    counts[key] = counts.get(key, 0) + 1
            out[name] = counts
    return out
