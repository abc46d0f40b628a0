"""Real SGLang as the local rollout servers (``rollout.engine: sglang``).

When ``rollout.servers`` is empty and the engine is sglang, the job's `LocalServers` starts
``python -m sglang.launch_server`` processes instead of megarl-server: from SGLang's own
virtualenv (``$MEGARL_SGLANG_VENV``, default ``~/.cache/megarl/sglang-venv``, made by
tools/sglang_cpu/install.sh), or from this Python when it imports sglang (``pip install
megarl[sglang]`` on a GPU node).

On a machine without CUDA, SGLang 0.5.x runs only with what tools/sglang_cpu/ carries (DESIGN.md,
"Facts learned"): ``SGLANG_USE_CPU_ENGINE=1``, the stand-in ``sgl_kernel`` package first on
``PYTHONPATH``, the torch-native attention and sampling backends, fp32 (its bf16 logprobs are
0.03-0.08 off an fp32 reference), an explicit KV-cache size, and ``SGLANG_DISABLED_MODEL_ARCHS``
naming every model module but the ones megarl converts (start-up ~4x faster on two cores). On GPU
it is the plain command; what the run's features need (routes, LoRA, the colocated placement's
``--enable-memory-saver``) comes from `megarl.config.server_flags.feature_flags`.
Start-up takes 40-80 s on two CPU cores (the first start ~3 min).

SGLang forks a scheduler and a detokenizer: each server is its own process group, killed whole.
tools/sglang_cpu/launch.py is a thin command-line user of this module.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import signal
import subprocess
import sys
from typing import Optional, Sequence

from megarl.common.errors import ConfigError
from megarl.common.signals import owned_child_setup
from megarl.config.server_flags import sglang_flags
from megarl.protocol.architectures import ARCHITECTURES
from megarl.rollout.local import key_pipe

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STANDIN_KERNEL = os.path.join(REPO, "tools", "sglang_cpu", "sgl_kernel_cpu")
VERSION = "0.5.23"
# SGLang model modules (HF model_type) of the architectures in megarl's one table, plus SGLang's
# own modules for the reward models megarl-server serves (Llama/Qwen2ForSequenceClassification,
# which SGLang serves with --is-embedding from llama_reward / qwen2_classification)
MEGARL_ARCHS = (*dict.fromkeys(a.model_type for a in ARCHITECTURES.values()), "llama_reward", "qwen2_classification")

def venv_dir() -> str:
    return os.environ.get("MEGARL_SGLANG_VENV") or os.path.expanduser("~/.cache/megarl/sglang-venv")


def installed_python() -> Optional[str]:
    """The venv's python when tools/sglang_cpu/install.sh completed for this version, else None."""
    py = os.path.join(venv_dir(), "bin", "python")
    stamp = os.path.join(venv_dir(), f".megarl-sglang-{os.environ.get('MEGARL_SGLANG_VERSION', VERSION)}")
    return py if os.path.isfile(stamp) and os.access(py, os.X_OK) else None


def sglang_python() -> str:
    """The Python that runs ``sglang.launch_server``: the SGLang venv's, else this one if it
    imports sglang; a one-line ConfigError naming rollout.engine otherwise."""
    py = installed_python()
    if py:
        return py
    if importlib.util.find_spec("sglang") is not None:
        return sys.executable
    raise ConfigError(f"rollout.engine: sglang, but SGLang is not installed (no venv at {venv_dir()} and no "
                      "sglang module here); run tools/sglang_cpu/install.sh or pip install 'megarl[sglang]'")


def cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def server_env(base: Optional[dict] = None, python: Optional[str] = None,
               models: Optional[Sequence[str]] = MEGARL_ARCHS, threads: Optional[int] = None) -> dict:
    """The environment SGLang needs on CPU. ``models``: SGLang model modules to import at start-up
    (None = all ~250; importing them all costs about a minute per process on two cores)."""
    env = dict(os.environ if base is None else base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    # The stand-in kernel package must shadow the CUDA-only wheel installed in the venv.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (STANDIN_KERNEL, env.get("PYTHONPATH", "")) if p)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("OMP_NUM_THREADS", "1")
    # Its venv ships no bytecode (uv compiles none): let the first start write it, or each of
    # SGLang's three processes recompiles every module it imports on every start (~2 min).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if models is not None and python is not None:
        skip = [m for m in _model_modules(python) if m not in models]
        env["SGLANG_DISABLED_MODEL_ARCHS"] = ",".join(skip)
    return env


def _model_modules(python: str) -> list[str]:
    """Module names under the venv's sglang/srt/models (found on disk, no import)."""
    venv = os.path.dirname(os.path.dirname(python))
    found = glob.glob(os.path.join(venv, "lib", "python*", "site-packages", "sglang", "srt", "models", "*.py"))
    return sorted(os.path.basename(f)[:-3] for f in found if not f.endswith("__init__.py"))


def server_args(model: str, port: int, host: str = "127.0.0.1", *, cpu: bool = True,
                max_total_tokens: int = 16384, max_running_requests: int = 64,
                api_key: Optional[str] = None, extra: Sequence[str] = ()) -> list[str]:
    """`python -m sglang.launch_server` arguments for a server on ``host:port``; ``cpu``: the
    settings SGLang needs without CUDA (fp32, torch-native backends, a fixed KV cache); ``extra``:
    the run's feature flags (`megarl.config.server_flags.feature_flags`: routes, LoRA, the memory
    saver a colocated placement needs on GPU) and rollout.server_args, last."""
    args = ["-m", "sglang.launch_server", "--model-path", model, "--host", host, "--port", str(port)]
    if cpu:
        args += ["--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
                 "--dtype", "float32", "--max-total-tokens", str(max_total_tokens),
                 "--mem-fraction-static", "0.05", "--max-running-requests", str(max_running_requests),
                 "--tp-size", "1", "--random-seed", "0", "--log-level", "warning"]
        if "--enable-lora" in extra:  # its default LoRA backend (csgmv) runs Triton kernels
            args += ["--lora-backend", "torch_native"]
    if api_key:
        args += [f"--api-key={api_key}"]  # one token: a key may start with "-" (token_urlsafe)
    return args + list(extra)  # last: a repeated option takes its last value


def check_model_dir(model_dir: str) -> None:
    """SGLang loads the tokenizer with transformers: a sentencepiece-only dir (megarl reads it,
    SGLang cannot) fails at its start-up after a minute; say so at once."""
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(f"model.hf_path: rollout.engine=sglang needs an HF tokenizer (tokenizer.json or "
                          f"tokenizer_config.json) in {model_dir}")


# `python -c PARSE_FLAGS ARGS...`: SGLang's own parser over ARGS; exit 0, or argparse's error line
PARSE_FLAGS = ("import argparse, sys; from sglang.srt.server_args import ServerArgs; "
               "p = argparse.ArgumentParser(prog='sglang.launch_server'); ServerArgs.add_cli_args(p); "
               "p.parse_args(sys.argv[1:])")


def check_sglang_flags(model_dir: str, flags: Sequence) -> str:
    """'' when SGLang's parser accepts ``flags`` (rollout.server_args as SGLang's, `sglang_flags`),
    else its error line. Importing SGLang's argument module takes ~10 s of CPU, so each verdict is
    kept in ~/.cache/megarl/sglang-flags.json, keyed by the flags and the SGLang install it came from."""
    import hashlib
    import json

    args = ["--model-path", model_dir, *sglang_flags(flags)]
    py = sglang_python()
    prefix = os.path.dirname(os.path.dirname(py))
    found = glob.glob(os.path.join(prefix, "lib", "python*", "site-packages", "sglang", "srt", "server_args.py"))
    if not found and py == sys.executable and importlib.util.find_spec("sglang") is not None:
        found = [os.path.join(os.path.dirname(importlib.util.find_spec("sglang").origin), "srt", "server_args.py")]
    try:
        install = [(f, os.stat(f).st_mtime_ns) for f in found]
    except OSError:
        install = []
    key = hashlib.sha256(json.dumps([py, install, args[2:]]).encode()).hexdigest()
    path = os.path.expanduser("~/.cache/megarl/sglang-flags.json")
    try:
        with open(path) as f:
            known = json.load(f)
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), str):
        return known[key]
    try:
        out = subprocess.run([py, "-c", PARSE_FLAGS, *args], capture_output=True, text=True, timeout=300,
                             env=server_env(python=py) if not cuda_available() else None)
    except subprocess.TimeoutExpired:
        return ""
    lines = out.stderr.strip().splitlines()
    if out.returncode == 0:
        verdict = ""
    elif out.returncode == 2 and lines and "error: " in lines[-1]:  # argparse's own refusal
        verdict = lines[-1].split("error: ", 1)[1]
    else:
        return ""  # SGLang failed to import: not a verdict on the flags (the server start says more)
    if not install:
        return verdict  # which SGLang answered is unknown: nothing to key a verdict by
    known = known if isinstance(known, dict) else {}
    known[key] = verdict
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "w") as f:
            json.dump(known, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a cache: the next run asks SGLang again
    return verdict


# `python -c KEYED_LAUNCH MODULE SOURCE ARGS...`: runs MODULE (sglang.launch_server, or the router
# sglang_router.launch_router) with ARGS and `--api-key KEY`, KEY read from SOURCE: an inherited
# pipe's descriptor number (a server megarl starts itself), or a key file that must be the user's
# own and readable by nobody else (a server megarl-launch plans on another node). The key is added
# to sys.argv inside the process (the kernel's copy, what /proc/PID/cmdline shows, keeps the
# command as started); SGLang's workers get their settings pickled by multiprocessing, not on a
# command line.
KEYED_LAUNCH = (
    "import os, runpy, sys; mod, src = sys.argv[1:3]; "
    "fd = int(src) if src.isdigit() else os.open(src, os.O_RDONLY | os.O_NOFOLLOW); st = os.fstat(fd); "
    "key = os.read(fd, 4096).decode().strip(); os.close(fd); "
    "src.isdigit() or (st.st_uid == os.geteuid() and not st.st_mode & 0o077) "
    "or sys.exit(f'--api-key-file: {src} must be yours and readable by nobody else (chmod 600)'); "
    "key or sys.exit(f'--api-key-file: {src} is empty'); "
    "sys.argv = [mod, *sys.argv[3:], '--api-key=' + key]; runpy.run_module(mod, run_name='__main__', alter_sys=True)")


def keyed(python: str, module_args: Sequence[str], source: str) -> list[str]:
    """``python -m MODULE ARGS`` (``module_args``: ``["-m", MODULE, *ARGS]``) as a KEYED_LAUNCH
    command whose key comes from ``source`` (a descriptor number or a key file's path)."""
    assert module_args[0] == "-m", module_args
    return [python, "-c", KEYED_LAUNCH, module_args[1], source, *module_args[2:]]


class SGLangLauncher:
    """Spawns one SGLang server per `LocalServers` slot (the megarl-server one is
    `megarl.rollout.local.MegarlLauncher`)."""

    name = "SGLang"

    def __init__(self, model_dir: str, extra=(), threads: Optional[int] = None, api_key: Optional[str] = None,
                 cpu: Optional[bool] = None, python: Optional[str] = None):
        check_model_dir(model_dir)
        self.python = python or sglang_python()
        self.model_dir, self.api_key, self.threads = model_dir, api_key, threads
        self.extra = sglang_flags(extra)
        self.cpu = (not cuda_available()) if cpu is None else cpu

    def argv(self, port: int, host: str, key_fd: Optional[int] = None) -> list[str]:
        """The command of the server on ``host:port``; ``key_fd``: a pipe holding its API key
        (`KEYED_LAUNCH`: SGLang itself reads --api-key from argv only)."""
        args = server_args(self.model_dir, port, host, cpu=self.cpu, extra=self.extra)
        return [self.python, *args] if key_fd is None else keyed(self.python, args, str(key_fd))

    def spawn(self, port: int, log_path: str, host: str, cpus=None) -> subprocess.Popen:
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        log = open(log_path, "a")  # append: a restarted server keeps its predecessor's log
        env = server_env(python=self.python, threads=self.threads) if self.cpu else dict(os.environ)
        with key_pipe(self.api_key) as fds:  # the key through a pipe: never argv, which /proc shows
            # its own session: the scheduler and detokenizer it forks are killed with it (kill())
            proc = subprocess.Popen(self.argv(port, host, fds[0] if fds else None), stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                    preexec_fn=owned_child_setup, pass_fds=fds)
        if cpus:
            os.sched_setaffinity(proc.pid, cpus)
        return proc

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        """SIGKILL the whole process group, the leader's children too (even if it is dead already)."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
