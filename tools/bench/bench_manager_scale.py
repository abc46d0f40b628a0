"""Benchmark: how many trajectories one rollout manager sustains, and the CPU it spends on each.

    python tools/bench/bench_manager_scale.py [--config configs/tiny_grpo.yaml]
        [--tokens 8 64 256] [--servers 2] [--steps 20] [--out docs/benchmarks.md]

The manager's own work - the real controller, workflow, reward, HTTP client and the step's
packing (`pack_batch`) - runs in this process against *null servers*: separate processes that
answer every `/generate` at once (no model) with ``--tokens`` output tokens in SGLang's response
shape. A consumer thread takes batches the size of the recipe's step and bumps the policy version
after each, as the trainer's pushes do. So the rate measured is the manager's ceiling: real
servers only make it wait longer. CPU is read from ``/proc`` for this process (the manager) and
for the null servers separately; the manager's CPU-seconds per trajectory is the figure that says
how many inference servers one manager can keep fed (docs/benchmarks.md works the example).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def serve(port: int, tokens: int, token_id: int) -> None:
    """A null server: /generate answers at once with ``tokens`` tokens of ``token_id``."""
    from aiohttp import web

    version = {"v": 0}
    ids = [token_id] * tokens
    meta_tail = {"finish_reason": {"type": "length", "length": tokens}, "prompt_tokens": 0,
                 "completion_tokens": tokens}

    def one(sp: dict) -> dict:
        n = min(tokens, int(sp.get("max_new_tokens", tokens)))
        meta = {**meta_tail, "output_token_logprobs": [[-0.5, t, None] for t in ids[:n]],
                "weight_version": str(version["v"]), "completion_tokens": n}
        return {"text": "", "output_ids": ids[:n], "meta_info": meta}

    async def generate(request):
        body = await request.json()
        sp = body.get("sampling_params") or {}
        if isinstance(body["input_ids"][0], list):  # a batch: one result per prompt
            sps = sp if isinstance(sp, list) else [sp] * len(body["input_ids"])
            return web.json_response([one(x) for x in sps])
        return web.json_response(one(sp))

    async def health(request):
        return web.json_response({})

    async def model_info(request):
        return web.json_response({"weight_version": str(version["v"])})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/model_info", model_info)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def start_null_servers(n: int, tokens: int, token_id: int) -> list[tuple[subprocess.Popen, str]]:
    from megarl.common.net import free_port

    out = []
    for _ in range(n):
        port = free_port()
        p = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--tokens", str(tokens),
                              "--token-id", str(token_id)])
        out.append((p, f"http://127.0.0.1:{port}"))
    import urllib.request

    for p, addr in out:
        for _ in range(200):
            try:
                urllib.request.urlopen(addr + "/health", timeout=1).read()
                break
            except OSError:
                time.sleep(0.05)
        else:
            raise RuntimeError(f"null server {addr} did not start")
    return out


def run(cfg_path: str, tokens: int, n_servers: int, steps: int, warmup: int) -> dict:
    from megarl.config.load import load_config
    from megarl.protocol.packing import pack_batch
    from megarl.rollout.cluster import RolloutCluster
    from megarl.rollout.setup import ControllerSpec, build_controller
    from megarl.common.tokenizer import load_tokenizer

    cfg = load_config(cfg_path, [f"rollout.max_new_tokens={tokens}", f"train.max_seq_len={tokens + 64}",
                                 "train.run_dir=/tmp/bench_manager_scale"])
    tok = load_tokenizer(cfg.data.tokenizer_path or cfg.model.hf_path)
    token_id = tok.encode("7")[-1]
    servers = start_null_servers(n_servers, tokens, token_id)
    try:
        # not the driver: the version clock and the addresses, no admin calls (nothing is pushed)
        cluster = RolloutCluster([a for _, a in servers], driver=False)
        spec = dataclasses.replace(ControllerSpec.from_config(cfg), failed_log=None)
        ctrl = build_controller(spec, cluster)
        cluster.subscribe(ctrl)
        ctrl.start()
        groups = spec.batch_groups
        me = os.getpid()
        t0 = c0 = s0 = None
        trajs = 0
        for v in range(warmup + steps):
            if v == warmup:
                t0, c0 = time.perf_counter(), cpu_seconds(me)
                s0 = sum(cpu_seconds(p.pid) for p, _ in servers)
            batch = ctrl.next_batch(groups, timeout_s=120)
            pack_batch(batch, 1, {}, [])
            if v >= warmup:
                trajs += len(batch)
            cluster.commit(v + 1)
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(me) - c0
        srv = sum(cpu_seconds(p.pid) for p, _ in servers) - s0
        ctrl.stop()
    finally:
        for p, _ in servers:
            p.terminate()
            p.wait()
    return {"tokens": tokens, "trajs": trajs, "wall": wall, "rate": trajs / wall,
            "cpu_ms": 1e3 * cpu / trajs, "srv_ms": 1e3 * srv / trajs, "util": cpu / wall,
            "tok_rate": trajs * tokens / wall, "groups": groups}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "tiny_grpo.yaml"))
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--token-id", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        serve(args.serve, args.tokens[0], args.token_id)
        return 0
    load = open("/proc/loadavg").read().split()[0]
    rows = ["| output tokens | trajectories/s | output tokens/s | manager CPU ms / trajectory | "
            "manager CPU use | null servers' CPU ms / trajectory |", "|---|---|---|---|---|---|"]
    for k in args.tokens:
        r = run(args.config, k, args.servers, args.steps, args.warmup)
        rows.append(f"| {k} | {r['rate']:,.0f} | {r['tok_rate']:,.0f} | {r['cpu_ms']:.2f} | "
                    f"{100 * r['util']:.0f}% | {r['srv_ms']:.2f} |")
        print(rows[-1], flush=True)
    text = "\n".join([f"load average at start {load}; {args.servers} null servers; batch "
                      f"{r['groups']} groups of the recipe's group size; {args.steps} steps per row", "",
                      *rows])
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
