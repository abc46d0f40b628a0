"""Environment servers under load (issue 44 item 4), in one invocation:

    python tools/bench/bench_env.py [--seconds 8] [--concurrency 1 16 64] [--steps 30]
        [--delay 0.25] [--out runs/bench_env]

1. What one megarl-env process sustains: GuessNumber episodes (reset, a wrong guess answered
   "higher", the right guess: two steps, done) driven by `EnvClient` at each concurrency for
   --seconds: episodes/s and steps/s, the HTTP round trip of a step (p50/p90), and the CPU one
   step costs the caller (this process: the rollout manager's side) and the server.
2. Whether asynchrony hides a slow environment: megarl-train on the demo model and prompts with
   EnvironmentWorkflow on GuessNumber (two turns), each step of the environment taking 0 or
   --delay seconds, synchronous (rollout.max_staleness 0) and asynchronous (1): the trainer's
   idle ratio (time waiting for a batch / step time) and seconds per step over steps 6..--steps.

Results in OUT/result.json and OUT/table.md.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rl_runs import REPO, fmt, markdown_table, read_rows, run_train, write_results  # noqa: E402

from megarl.envs import Action, EnvClient, Task  # noqa: E402

GUESS = "megarl.envs.examples:GuessNumber"


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_env(work: str, key: str) -> tuple[subprocess.Popen, str]:
    key_path = os.path.join(work, "key")
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key)
    log_path = os.path.join(work, "env.log")
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "megarl.envs", GUESS, "--port", "0", "--api-key-file", key_path,
                             "--max-episodes", "1024", "--log-level", "WARNING"], stdout=log, stderr=subprocess.STDOUT)
    # --log-level WARNING hides the ready line: wait on /health of the port it bound instead
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        port = listening_port(proc.pid)
        if port:
            return proc, f"http://127.0.0.1:{port}"
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"megarl-env did not start (log {log_path})")


def listening_port(pid: int) -> int:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    m = re.search(rf"127\.0\.0\.1:(\d+)\s.*pid={pid},", out)
    return int(m.group(1)) if m else 0


async def drive(url: str, key: str, concurrency: int, seconds: float) -> dict:
    episodes = steps = 0
    lat: list[float] = []
    stop = time.perf_counter() + seconds

    async with EnvClient([url], key, timeout_s=30) as env:
        async def worker():
            nonlocal episodes, steps
            while time.perf_counter() < stop:
                ep = await env.reset(Task("", {"answer": 42}))
                for guess in ("7", "42"):
                    t = time.perf_counter()
                    r = await env.step(ep, Action(guess))
                    lat.append(time.perf_counter() - t)
                    steps += 1
                assert r.done and r.reward == 1.0, r
                episodes += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    lat.sort()
    return {"episodes": episodes, "steps": steps, "p50_ms": 1e3 * lat[len(lat) // 2],
            "p90_ms": 1e3 * lat[int(len(lat) * 0.9)]}


def throughput(concurrency: list[int], seconds: float) -> list[dict]:
    key = secrets.token_urlsafe(32)
    with tempfile.TemporaryDirectory() as work:
        proc, url = start_env(work, key)
        try:
            asyncio.run(drive(url, key, 4, 1.0))  # warm-up
            rows = []
            for c in concurrency:
                s0, c0, t0 = proc_cpu_s(proc.pid), time.process_time(), time.perf_counter()
                r = asyncio.run(drive(url, key, c, seconds))
                wall = time.perf_counter() - t0
                r.update(concurrency=c, wall_s=wall, episodes_per_s=r["episodes"] / wall,
                         steps_per_s=r["steps"] / wall,
                         caller_cpu_us_per_step=1e6 * (time.process_time() - c0) / r["steps"],
                         server_cpu_us_per_step=1e6 * (proc_cpu_s(proc.pid) - s0) / r["steps"])
                print(f"[bench] concurrency {c}: {r['episodes_per_s']:.0f} episodes/s", flush=True)
                rows.append(r)
            return rows
        finally:
            proc.terminate()
            proc.wait(10)


def idle_runs(out: str, steps: int, delay: float) -> list[dict]:
    rows = []
    for staleness in (0, 1):
        for d in (0.0, delay):
            name = f"staleness{staleness}_delay{d:g}"
            over = [f"train.steps={steps}", "rollout.group_size=4", "train.global_batch_size=32",
                    "train.max_seq_len=48", "rollout.workflow=megarl.rollout.workflows:EnvironmentWorkflow",
                    'rollout.workflow_args={"max_turns": 2}', f"env.cls={GUESS}",
                    'env.args={"delay_s": %g}' % d, f"rollout.max_staleness={staleness}",
                    "rollout.eval_at_start=false", "rollout.eval_interval=0", "checkpoint.save_interval=0",
                    "logging.log_interval=1"]
            s = run_train(os.path.join(out, name), over, name=name)
            m = [r for r in read_rows(os.path.join(out, name, "metrics.jsonl")) if r["step"] > 5]
            rows.append({"name": name, "staleness": staleness, "delay_s": d,
                         "trainer_idle": statistics.fmean(r["trainer_idle_ratio"] for r in m),
                         "s_per_step": statistics.fmean(r["step_time"] for r in m),
                         "turns": statistics.fmean(r["episode/turns"] for r in m),
                         "reward": statistics.fmean(r["reward"] for r in m), "summary_s_per_step": s.s_per_step})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--delay", type=float, default=0.25)
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "bench_env"))
    a = ap.parse_args(argv)
    tp = throughput(a.concurrency, a.seconds)
    idle = idle_runs(a.out, a.steps, a.delay)
    md = ("One megarl-env process (GuessNumber, two steps an episode), driven by EnvClient:\n\n" + markdown_table(
        ["concurrency", "episodes/s", "steps/s", "step p50 ms", "step p90 ms", "caller CPU us/step",
         "server CPU us/step"],
        [[r["concurrency"], fmt(r["episodes_per_s"], ".0f"), fmt(r["steps_per_s"], ".0f"), fmt(r["p50_ms"], ".2f"),
          fmt(r["p90_ms"], ".2f"), fmt(r["caller_cpu_us_per_step"], ".0f"), fmt(r["server_cpu_us_per_step"], ".0f")]
         for r in tp])
        + f"\n\nA slow environment and the trainer (demo model, GuessNumber, 2 turns, steps 6..{a.steps}):\n\n"
        + markdown_table(["run", "rollout.max_staleness", "env step delay s", "trainer idle ratio", "s/step",
                          "turns/episode"],
                         [[r["name"], r["staleness"], fmt(r["delay_s"], "g"), fmt(r["trainer_idle"]),
                           fmt(r["s_per_step"], ".2f"), fmt(r["turns"], ".2f")] for r in idle]))
    write_results(a.out, {"throughput": tp, "idle": idle}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
