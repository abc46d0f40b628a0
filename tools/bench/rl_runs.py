"""Shared by the benchmarks: run `megarl-train` on the demo task and read its clock; start a
megarl-server and re-run a bench script under torchrun against it (the push benchmarks).

    summary = run_train(run_dir, overrides)   # -> RunSummary of metrics.jsonl
    return torchrun_with_server(__file__, hf, work, nproc)   # ranks see BENCH_* variables

Training wall time excludes evaluation everywhere: a run's clock starts when its first step starts
(first row's `time - step_time`) and every row's `time/eval` (blocking held-out evaluation through
the rollout server) is subtracted, so "seconds to accuracy" is comparable between runs that
evaluate at different intervals and with TRL's timing (bench_vs_trl.py). Process start-up (imports,
server start, model load) is reported separately as `process_s`.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(REPO, "examples", "tiny", "data")


@dataclass
class RunSummary:
    name: str
    start_accuracy: Optional[float]
    final_accuracy: Optional[float]
    steps: int
    trained_samples: int
    train_s: float
    """Training seconds over all steps, evaluation excluded."""
    samples_per_s: float
    s_per_step: float
    time_to_target_s: Optional[float] = None
    steps_to_target: Optional[int] = None
    process_s: float = 0.0
    evals: list = field(default_factory=list)
    """[{step, accuracy, train_s}] including step 0 (rollout.eval_at_start)."""
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(name: str, rows: list[dict], target: Optional[float] = None) -> RunSummary:
    steps = [r for r in rows if r["step"] >= 1]
    if not steps:
        raise RuntimeError(f"{name}: no training steps in metrics.jsonl")
    t0 = steps[0]["time"] - steps[0]["step_time"]
    evals, eval_s = [], 0.0
    for r in rows:
        if r["step"] >= 1:
            eval_s += r.get("time/eval", 0.0)
        if "eval_accuracy" in r:
            train_s = max(0.0, r["time"] - t0 - eval_s) if r["step"] else 0.0
            evals.append({"step": r["step"], "accuracy": r["eval_accuracy"], "train_s": train_s})
    train_s = steps[-1]["time"] - t0 - eval_s
    samples = sum(int(r.get("trained_samples", 0)) for r in steps)
    hit = next((e for e in evals if e["step"] and target is not None and e["accuracy"] >= target), None)
    return RunSummary(
        name=name, start_accuracy=evals[0]["accuracy"] if evals and evals[0]["step"] == 0 else None,
        final_accuracy=evals[-1]["accuracy"] if evals else None, steps=steps[-1]["step"],
        trained_samples=samples, train_s=train_s, samples_per_s=samples / max(train_s, 1e-9),
        s_per_step=train_s / len(steps), time_to_target_s=hit["train_s"] if hit else None,
        steps_to_target=hit["step"] if hit else None, evals=evals)


def process_role(cmdline: list[str]) -> str:
    """Which program of the job a process is, from its command line: ``server`` (megarl-server),
    ``manager`` (the rollout manager), ``reward`` (a reward worker process), else ``trainer``
    (megarl-train, torchrun and its ranks)."""
    line = " ".join(cmdline)
    if "megarl.server" in line:
        return "server"
    if "megarl.rollout.manager" in line:
        return "manager"
    if "megarl.rewards" in line:
        return "reward"
    return "trainer"


class CpuSampler:
    """CPU seconds used by a process tree (the trainer, the rollout manager, the servers, reward
    workers: every descendant), sampled from /proc every ``interval_s``, in total and per role
    (`process_role`). A process that exits keeps the CPU time it was last seen with.
    `utilization(t0, t1)`: used CPU seconds over the window divided by (cores x seconds) - 1.0
    means every core of the machine was busy; `role_cpu(t0, t1)`: CPU seconds per role."""

    def __init__(self, pid: int, interval_s: float = 0.5):
        import psutil

        self.root, self.interval_s = psutil.Process(pid), interval_s
        self.cores = len(os.sched_getaffinity(0))
        self.samples: list[tuple[float, float]] = []  # (time.time(), CPU seconds of the tree)
        self.role_samples: list[tuple[float, dict]] = []  # (time.time(), {role: CPU seconds})
        self.peak_rss = 0
        self._seen: dict[int, tuple[str, float]] = {}  # pid -> (role, CPU seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree_cpu(self) -> float:
        import psutil

        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            procs = []
        rss = 0
        for p in procs:
            try:
                t = p.cpu_times()
                role = self._seen[p.pid][0] if p.pid in self._seen else process_role(p.cmdline())
                self._seen[p.pid] = (role, t.user + t.system)
                rss += p.memory_info().rss
            except psutil.Error:
                pass
        self.peak_rss = max(self.peak_rss, rss)  # the whole job's resident memory at its peak
        return sum(c for _, c in self._seen.values())

    def _run(self) -> None:
        while not self._stop.is_set():
            now, total = time.time(), self._tree_cpu()
            roles: dict[str, float] = {}
            for role, c in self._seen.values():
                roles[role] = roles.get(role, 0.0) + c
            self.samples.append((now, total))
            self.role_samples.append((now, roles))
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def utilization(self, t0: float, t1: float) -> Optional[float]:
        inside = [(t, c) for t, c in self.samples if t0 <= t <= t1]
        if len(inside) < 2:
            return None
        (ta, ca), (tb, cb) = inside[0], inside[-1]
        return (cb - ca) / (self.cores * (tb - ta)) if tb > ta else None

    def role_cpu(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds each role used between the first and last sample inside [t0, t1]."""
        inside = [r for t, r in self.role_samples if t0 <= t <= t1]
        if len(inside) < 2:
            return {}
        a, b = inside[0], inside[-1]
        return {role: b[role] - a.get(role, 0.0) for role in sorted(b)}


def run_train(*args, **kwargs) -> RunSummary:
    """`_run_train`, retried (twice) when the run died on a port another process took between
    megarl's free_port() and its bind (seen on the shared benchmark machine)."""
    for attempt in range(3):
        try:
            return _run_train(*args, **kwargs)
        except RuntimeError as e:
            log = str(e).rsplit("(log ", 1)[-1].rstrip(")")
            if attempt == 2 or not os.path.exists(log) or "address already in use" not in open(log).read():
                raise
            print(f"[bench] port taken by another process, retrying: {e}", flush=True)
    raise AssertionError("unreachable")


def _run_train(run_dir: str, overrides: list[str], name: Optional[str] = None,
              target: Optional[float] = None, config: str = "configs/tiny_grpo.yaml",
              log: Optional[str] = None, env: Optional[dict] = None,
              budget_s: Optional[float] = None) -> RunSummary:
    """`python -m megarl.train CONFIG` on the demo data with `overrides` (last wins), fresh run dir.
    The child gets OMP_NUM_THREADS=1 unless `env` says otherwise (a None value unsets a variable).
    With `budget_s` the run (its process group: trainer and local servers) is killed once its
    training time (evaluation excluded) passes the budget; the steps logged so far are summarized."""
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "megarl.train", os.path.join(REPO, config),
           f"data.train_path={DATA}/rl_prompts.jsonl", f"data.eval_path={DATA}/eval_prompts.jsonl",
           f"train.run_dir={run_dir}", "checkpoint.hf_export_dir=", "logging.timeline=false",
           *overrides]
    print("[bench] " + " ".join(cmd[2:]), flush=True)
    t = time.perf_counter()
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    child_env = {k: v for k, v in child_env.items() if v is not None}  # None: unset it
    metrics = os.path.join(run_dir, "metrics.jsonl")
    stopped = False
    with open(log or os.path.join(run_dir, "train.log"), "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=child_env,
                                start_new_session=budget_s is not None)
        sampler = CpuSampler(proc.pid)
        while proc.poll() is None:
            time.sleep(2.0)
            if budget_s is not None and os.path.exists(metrics):
                rows = [r for r in read_rows(metrics) if r["step"] >= 1]
                if rows and summarize("", rows).train_s > budget_s:
                    os.killpg(proc.pid, signal.SIGKILL)  # the trainer and the servers it started
                    proc.wait()
                    stopped = True
    sampler.stop()
    if proc.returncode and not stopped:
        raise RuntimeError(f"{name or run_dir}: megarl-train failed (log {out.name})")
    rows = read_rows(metrics)
    summary = summarize(name or os.path.basename(run_dir), rows, target)
    summary.process_s = time.perf_counter() - t
    steps = [r for r in rows if r["step"] >= 1]
    # the training window: first step's start to the last step's end (start-up excluded)
    window = (steps[0]["time"] - steps[0]["step_time"], steps[-1]["time"])
    summary.extra["cpu_util"] = sampler.utilization(*window)
    # per program, over the training window (evaluation runs beside training and is included)
    summary.extra["cpu_s_by_role"] = sampler.role_cpu(*window)
    summary.extra["budget_stopped"] = stopped
    summary.extra["peak_rss_mb"] = sampler.peak_rss / 2**20
    return summary


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(out_dir: str, results, md: str) -> None:
    """<out_dir>/result.json (every run's numbers) and <out_dir>/table.md; the table is printed."""
    print(md)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(md + "\n")


def fmt(x, spec: str = ".3f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def torchrun_with_server(script: str, hf: str, work: str, nproc: int, server_args=(),
                         ready_timeout_s: float = 60.0) -> int:
    """Starts a megarl-server on ``hf`` (log in ``work``), then ``script`` (with this process's
    arguments) under torchrun on loopback; the ranks find the server in BENCH_SERVER (its pid in
    BENCH_SERVER_PID), the model in BENCH_HF, the scratch directory in BENCH_WORK. Returns
    torchrun's exit status; the server is killed either way."""
    from megarl.common.net import free_port
    from megarl.rollout.local import start_server

    url, proc = start_server(hf, os.path.join(work, "server.log"), list(server_args), ready_timeout_s=ready_timeout_s)
    try:
        env = dict(os.environ, BENCH_HF=hf, BENCH_SERVER=url, BENCH_WORK=work, OMP_NUM_THREADS="1",
                   BENCH_SERVER_PID=str(proc.pid))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(free_port()), os.path.abspath(script), *sys.argv[1:]]
        return subprocess.call(cmd, env=env)
    finally:
        proc.kill()
