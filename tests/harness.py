"""The one way a test runs `megarl-train` (tests/README.md, "The run harness").

    run = harness.train(run_dir, "train.steps=3", "rollout.max_staleness=0")
    run.check()                       # exit 0, or the tail of its stderr
    run.rows, run.generations, run.timeline(), run.log, run.last_line

`train` runs the real command (`python -m megarl.train RECIPE a.b=c ...`) as a subprocess on
the tiny demo model and data unless told otherwise, one thread per process (2 cores), and
returns a `Run`: its exit code, output, wall time and what it wrote. `during=fn` calls
fn(proc) while the run is alive (a probe, a fault); the run is then waited for, and what fn
returned is `Run.probe` (a shared run can carry a probe: pass the same fn on every call). A probe
that raises kills the run (its process group with `start_new_session=True`, which a test that
signals the whole job needs) and fails with the tail of the run's output. `rows_so_far(run_dir)`
is a probe's view of metrics.jsonl while the run writes it, `run_dir_of(proc)` the probe's run.
`plugin_env()` puts tests/e2e on the run's PYTHONPATH (rollout.reward_fn=reward_plugins:...).

Runs whose properties can be read from one run share it: the `shared_train` fixture
(tests/conftest.py) returns the run made earlier in this pytest session with the same
arguments, or makes it. A shared run is only read: a test that changes its directory, or
needs its own servers, runs its own.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Callable

REPO = pathlib.Path(__file__).resolve().parents[1]
E2E = REPO / "tests" / "e2e"
TINY = REPO / "examples" / "tiny"
TINY_MOE = REPO / "examples" / "tiny_moe"


def demo_args(run_dir, recipe: str = "tiny_grpo.yaml", model=None, data=None, eval_data: str = "") -> list[str]:
    """The recipe on the tiny demo's model and prompts, no held-out evaluation, no HF export."""
    model = model or TINY / "model"
    data = data or TINY / "data" / "rl_prompts.jsonl"
    return [str(REPO / "configs" / recipe), f"model.hf_path={model}", f"data.train_path={data}",
            f"data.eval_path={eval_data}", f"train.run_dir={run_dir}", "checkpoint.hf_export_dir="]


def command(run_dir, *overrides: str, recipe: str = "tiny_grpo.yaml", model=None, data=None,
            eval_data: str = "") -> list[str]:
    return [sys.executable, "-m", "megarl.train",
            *demo_args(run_dir, recipe, model, data, eval_data), *overrides]


def run_env(extra: dict | None = None) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", **(extra or {}))


def plugin_env(extra: dict | None = None) -> dict:
    """`env=` for a run that imports test plugins from tests/e2e (reward_plugins, ...)."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, (str(E2E), os.environ.get("PYTHONPATH")))), **(extra or {})}


def _jsonl(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rows_so_far(run_dir, name: str = "metrics.jsonl") -> list[dict]:
    """The complete lines of a jsonl file a live run is appending to (a line being written is
    skipped, not parsed): what a `during` probe reads. A finished run's: `Run.rows`."""
    path = pathlib.Path(run_dir) / name
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


def run_dir_of(proc: subprocess.Popen) -> pathlib.Path:
    """The run directory of a live `train` process (its train.run_dir=): for a `during` probe
    that is not a closure over it, as a shared run's is not."""
    return pathlib.Path(next(a for a in proc.args if a.startswith("train.run_dir=")).split("=", 1)[1])


@dataclasses.dataclass
class Run:
    """One finished `megarl-train` process and its run directory."""

    dir: pathlib.Path
    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    probe: object = None  # what train(during=fn)'s fn returned
    ended: float = 0.0  # time.monotonic() once it had exited and its output closed (no process holds it)

    @property
    def rows(self) -> list[dict]:
        """metrics.jsonl, one dict per step."""
        return _jsonl(self.dir / "metrics.jsonl")

    @property
    def generations(self) -> list[dict]:
        """generations.jsonl (logging.dump_generations=true)."""
        return _jsonl(self.dir / "generations.jsonl")

    def jsonl(self, name: str) -> list[dict]:
        """Any jsonl file of the run directory (eval_generations.jsonl, ...)."""
        return _jsonl(self.dir / name)

    def timeline(self, rank: int = 0) -> list[dict]:
        """timeline/rank<N>.jsonl (logging.timeline=true)."""
        return _jsonl(self.dir / "timeline" / f"rank{rank}.jsonl")

    @property
    def log(self) -> str:
        return self.stdout + self.stderr

    @property
    def last_line(self) -> str:
        lines = self.stderr.strip().splitlines()
        return lines[-1] if lines else ""

    def check(self) -> "Run":
        """The run exited 0; otherwise fail with the tail of its output."""
        assert self.returncode == 0, f"exit {self.returncode}\n{self.stdout[-2000:]}\n{self.stderr[-4000:]}"
        return self


def train(run_dir, *overrides: str, recipe: str = "tiny_grpo.yaml", model=None, data=None,
          eval_data: str = "", env: dict | None = None, timeout: float = 600, cwd=None,
          during: Callable[[subprocess.Popen], None] | None = None, check: bool = False,
          start_new_session: bool = False) -> Run:
    """Runs megarl-train once into ``run_dir`` (see the module docstring)."""
    run_dir = pathlib.Path(run_dir)
    cmd = command(run_dir, *overrides, recipe=recipe, model=model, data=data, eval_data=eval_data)
    cwd = str(cwd or run_dir.parent)
    os.makedirs(cwd, exist_ok=True)
    t0, probe = time.monotonic(), None
    if during is None:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=run_env(env),
                              start_new_session=start_new_session)
        out, err, code, ended = proc.stdout, proc.stderr, proc.returncode, time.monotonic()
    else:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                              env=run_env(env), start_new_session=start_new_session) as proc:
            import threading

            outs: dict[str, str] = {}
            def read():
                outs.update(zip(("out", "err"), proc.communicate(timeout=timeout)))
                outs["ended"] = time.monotonic()

            reader = threading.Thread(target=read, daemon=True)
            reader.start()

            def kill():
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL) if start_new_session else proc.kill()

            try:
                probe = during(proc)
            except BaseException as e:  # a failed probe: the run is not waited for
                kill()
                reader.join(30)
                e.add_note(f"megarl-train ({run_dir}), killed when the probe failed; its output ends:\n"
                           f"{outs.get('out', '')[-2000:]}\n{outs.get('err', '')[-8000:]}")
                raise
            finally:
                reader.join(timeout)
                kill()  # past the timeout (communicate gave up): never wait on a live run
                reader.join(10)
            out, err, code = outs.get("out", ""), outs.get("err", ""), proc.wait()
            ended = outs.get("ended", time.monotonic())
    run = Run(run_dir, cmd, code, out, err, time.monotonic() - t0, probe, ended)
    return run.check() if check else run


class SharedRuns:
    """Runs made once per pytest session, keyed by their arguments (the `shared_train` fixture)."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self.runs: dict[tuple, Run] = {}

    def __call__(self, *overrides: str, recipe: str = "tiny_grpo.yaml", **kw) -> Run:
        key = (recipe, overrides, tuple(sorted((k, str(v)) for k, v in kw.items())))
        if key not in self.runs:
            run_dir = self.root / f"shared{len(self.runs)}" / "run"
            self.runs[key] = train(run_dir, *overrides, recipe=recipe, **kw)
        return self.runs[key]
