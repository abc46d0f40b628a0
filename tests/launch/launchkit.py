"""Helpers of the launch tier: the environment every launched process gets (this checkout first on
PYTHONPATH, one thread, no SLURM/MPI/launcher variables from the caller), the demo config's
overrides, metrics rows, and a thin client of the test cluster (sbatch, squeue states, waits)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER_SH = os.path.join(REPO, "tools", "slurm_ci", "cluster.sh")
_STRIP = ("SLURM_", "OMPI_", "PMIX_", "PMI_")
_LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIP) and k not in _LAUNCHER}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHON=sys.executable,
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def demo_overrides(run_dir, steps: int, *more: str) -> list[str]:
    """configs/tiny_grpo.yaml with absolute paths, no eval, no HF export."""
    return [os.path.join(REPO, "configs", "tiny_grpo.yaml"), f"model.hf_path={REPO}/examples/tiny/model",
            f"data.train_path={REPO}/examples/tiny/data/rl_prompts.jsonl", "data.eval_path=",
            f"train.run_dir={run_dir}", "checkpoint.hf_export_dir=", "train.global_batch_size=64", "rollout.eval_at_start=false", f"train.steps={steps}", *more]


def metric_rows(run_dir) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def free_port_run(n: int) -> int:
    """A port p with p .. p+n-1 all free on every loopback address we use."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + n > 65000:
            continue
        try:
            for q in range(p, p + n):
                with socket.socket() as s:
                    s.bind(("", q))
            return p
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


class Slurm:
    def __init__(self, base: str):
        self.base = base
        self.env = clean_env(SLURM_CONF=os.path.join(base, "etc", "slurm.conf"))

    def run(self, *cmd, check=True, timeout=60, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=kw.pop("env", self.env), capture_output=True, text=True,
                              check=check, timeout=timeout, **kw)

    def sbatch(self, *args, cwd, env=None) -> int:
        out = self.run("sbatch", "--parsable", f"--chdir={cwd}", *args, env=env or self.env, cwd=str(cwd))
        return int(out.stdout.strip().split(";")[0])

    def state(self, jid: int) -> str:
        """squeue's state code (R, PD, CG, ...) or "" once the job has left the queue."""
        return self.run("squeue", "-h", "-j", str(jid), "-o", "%t", check=False).stdout.strip()

    def show(self, jid: int) -> str:
        return self.run("scontrol", "show", "job", str(jid), check=False).stdout

    def start_now(self, jid: int) -> None:
        """Make a requeued job eligible now (a requeue sets BeginTime ~2 min out); the update also
        wakes the scheduler. An error once the job runs is expected and ignored."""
        self.run("scontrol", "update", f"jobid={jid}", "StartTime=now", check=False)

    def start_soon(self, jid: int) -> None:
        """``start_now`` for a job just requeued, but not in the second of the requeue: slurmd has
        just revoked the job's credential, and a start then fails the job ("Killing non-startable
        batch job: Job credential revoked"). Not a future StartTime either: nothing wakes the
        scheduler when that time comes (it may wait for its next periodic pass, ~60 s)."""
        time.sleep(2)
        self.start_now(jid)

    def diagnose(self, jid: int) -> str:
        """What to read when a wait times out: the job as slurmctld sees it and its log's tail."""
        log = os.path.join(self.base, "log", "slurmctld.log")
        tail = open(log).read().splitlines()[-25:] if os.path.exists(log) else []
        return self.show(jid) + "\nslurmctld.log:\n" + "\n".join(tail)

    def wait_state(self, jid: int, states: tuple, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.state(jid)
            if st in states:
                return st
            time.sleep(0.3)
        raise AssertionError(f"job {jid} not in {states} after {timeout:.0f}s: {self.diagnose(jid)}")

    def wait_done(self, jid: int, timeout: float = 300) -> None:
        self.wait_state(jid, ("",), timeout)


def wait_rows(run_dir, n: int, timeout: float = 300, nudge=None, diagnose=None) -> list[dict]:
    """Until metrics.jsonl has ``n`` rows; ``nudge()`` every 5 s meanwhile (e.g. pull a requeued
    job's start time in again: an update that raced the requeue is otherwise lost for ~2 min);
    ``diagnose()`` is appended to the timeout's message."""
    last = time.monotonic()
    deadline = last + timeout
    while time.monotonic() < deadline:
        rows = metric_rows(run_dir)
        if len(rows) >= n:
            return rows
        if nudge is not None and time.monotonic() - last >= 5:
            last = time.monotonic()
            nudge()
        time.sleep(0.2)
    extra = "\n" + diagnose() if diagnose is not None else ""
    raise AssertionError(f"fewer than {n} metrics rows in {run_dir} after {timeout:.0f}s{extra}")
