"""Asynchronous vs synchronous GRPO on a workload shaped like real RL (generation >= 65% of a
synchronous step): trained samples/s, time to a held-out accuracy, final accuracy, CPU use.

    python tools/bench/bench_async.py [--steps 40] [--seeds 1,2] [--modes sync_colo,sync_disagg,async_s4,async_s4_shared]

Workload: the demo task and start point (configs/tiny_grpo.yaml, examples/tiny/model) with
long-tailed response lengths: `LongTailWorkflow` gives every sample its own budget,
P(len > x) = 4 / x on [4, --cap] tokens, and `rollout.ignore_eos` makes it generate exactly that
many, so a synchronous step waits for its longest sample while the server's batch drains - the
shape of RL on GPUs, where generation is 70-80% of a synchronous step. The share of generation in
a synchronous step is measured (the trainer's wait for its batch / the step) and printed.

Modes, all on the same cores (the machine's two):
    sync_colo     on-policy (max_staleness 0, no partial rollouts), unpinned: each phase may use
                  every core in turn; trainer 2 threads, server 1 (its decode of one long sample
                  is slower on 2 threads: measured 1.45 s vs 0.92 s per step at cap 1024)
    sync_disagg   on-policy; server (and the rollout manager) pinned to CPU 1, trainer to CPU 0,
                  one thread each: a cluster with rollout and trainer GPUs
    async_sK      max_staleness K with partial rollouts (weights.pause_mode in_place:
                  in-flight requests keep their KV cache and continue under the new weights,
                  each token stamped with its version), pinned like sync_disagg
    async_s4_shared   max_staleness 4 as above, nothing pinned, two local servers: a generation-
                  bound trainer's idle core serves requests too

Reported per run: trained samples/s (evaluation excluded), seconds to --target, final accuracy,
CPU utilisation of the job's whole process tree over its training window (/proc), the phase times;
per mode the mean over seeds and the ratios to both synchronous baselines. OUT/result.json,
OUT/table.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rl_runs import REPO, fmt, markdown_table, read_rows, run_train, write_results  # noqa: E402


def long_context_model(out: str, positions: int) -> str:
    """The demo's start point with room for long responses: the same weights (RoPE needs no
    position table), max_position_embeddings raised. Tokens past the answer's EOS are scored by
    nothing - they only make generation long, as reasoning traces do."""
    src = os.path.join(REPO, "examples", "tiny", "model")
    dst = os.path.join(out, f"model_{positions}")
    if not os.path.exists(dst):
        shutil.copytree(src, dst)
        with open(os.path.join(src, "config.json")) as f:
            config = json.load(f)
        config["max_position_embeddings"] = positions
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
    return dst


def workload(cap: int, model: str) -> list[str]:
    # micro-batches of <= 1024 padded tokens: the few long rows do not pad the many short ones
    return [f"model.hf_path={model}", "rollout.workflow=megarl.rollout.workflows:LongTailWorkflow",
            "rollout.ignore_eos=true", f"rollout.max_new_tokens={cap}", f"train.max_seq_len={cap + 16}",
            "train.global_batch_size=64", "train.micro_batch_tokens=1024"]


def modes() -> dict[str, list[str]]:
    pinned = ["rollout.server_cpus=[1]", "rollout.server_threads=1", "train.torch_threads=1"]
    asynchronous = lambda k: [f"rollout.max_staleness={k}", "rollout.partial_rollout=true",  # noqa: E731
                              "weights.pause_mode=in_place", *pinned]
    return {
        "sync_colo": ["rollout.max_staleness=0", "rollout.partial_rollout=false", "rollout.server_cpus=[]",
                      "rollout.server_threads=1", "train.torch_threads=2"],
        "sync_disagg": ["rollout.max_staleness=0", "rollout.partial_rollout=false", *pinned],
        **{f"async_s{k}": asynchronous(k) for k in (1, 2, 4, 8)},
        # nothing pinned and two servers: whichever process has work gets a core (CPU use >= 90%)
        "async_s4_shared": ["rollout.max_staleness=4", "rollout.partial_rollout=true",
                            "weights.pause_mode=in_place", "rollout.server_cpus=[]", "rollout.local_servers=2",
                            "rollout.server_threads=1", "train.torch_threads=1"],
    }


def phase_means(rows: list[dict]) -> dict:
    steps = [r for r in rows if r["step"] >= 2]  # step 1 pays the first compile-free warm-up
    mean = lambda k: statistics.fmean(r.get(k, 0.0) for r in steps)  # noqa: E731
    step = mean("step_time") - mean("time/eval")
    return {"step_s": step, "wait_s": mean("time/wait"), "update_s": mean("time/update"),
            "push_s": mean("time/push"), "gen_share": mean("time/wait") / step if step else None,
            "staleness_mean": mean("staleness_mean"), "partial_frac": mean("partial_frac"),
            "response_len": mean("response_len")}


def run_all(args) -> dict:
    results: dict = {}
    table = modes()
    model = long_context_model(args.out, args.cap + 16)
    for seed in [int(s) for s in args.seeds.split(",")]:
        for mode in args.modes.split(","):
            overrides = [*workload(args.cap, model), *table[mode],
                         f"rollout.workflow_args={{min_new_tokens: 4, alpha: 1.0, seed: {seed}}}",
                         f"train.seed={seed}", f"train.steps={args.steps}",
                         f"rollout.eval_interval={args.eval_every}", "rollout.eval_size=500",
                         "rollout.eval_at_start=true", *args.override]
            run_dir = os.path.join(args.out, f"{mode}_seed{seed}")
            r = run_train(run_dir, overrides, f"{mode}/seed{seed}", args.target)
            r.extra.update(phase_means(read_rows(os.path.join(run_dir, "metrics.jsonl"))))
            results[f"{mode}/seed{seed}"] = r.as_dict()
            e = r.extra
            print(f"[bench_async] {mode} seed {seed}: {r.samples_per_s:.1f} samples/s, accuracy "
                  f"{fmt(r.start_accuracy)} -> {fmt(r.final_accuracy)}, to {args.target}: "
                  f"{fmt(r.time_to_target_s, '.1f')} s, cpu {fmt(e.get('cpu_util'), '.2f')}, "
                  f"generation share of a step {fmt(e.get('gen_share'), '.2f')}", flush=True)
    return results


def summarize(results: dict, args) -> str:
    by_mode: dict = {}
    for key, r in results.items():
        by_mode.setdefault(key.split("/")[0], []).append(r)
    mean = lambda rs, f: statistics.fmean(f(r) for r in rs) if rs else None  # noqa: E731
    sps = {m: mean(rs, lambda r: r["samples_per_s"]) for m, rs in by_mode.items()}
    rows = []
    for mode, rs in by_mode.items():
        hits = [r["time_to_target_s"] for r in rs if r["time_to_target_s"] is not None]
        ratio = lambda base: f"**{sps[mode] / sps[base]:.2f}x**" if base in sps else "-"  # noqa: E731
        tok_s = mean(rs, lambda r: r["samples_per_s"] * r["extra"]["response_len"])
        rows.append([mode, f"{sps[mode]:.1f}", ratio("sync_disagg"), ratio("sync_colo"), f"{tok_s:.0f}",
                     f"{statistics.fmean(hits):.0f} ({len(hits)}/{len(rs)})" if hits else "-",
                     " / ".join(fmt(r["final_accuracy"]) for r in rs),
                     fmt(mean(rs, lambda r: r["extra"].get("cpu_util") or 0.0), ".2f"),
                     fmt(mean(rs, lambda r: r["extra"]["gen_share"]), ".2f"),
                     f"{mean(rs, lambda r: r['extra']['step_s']):.2f} = "
                     f"{mean(rs, lambda r: r['extra']['wait_s']):.2f} + {mean(rs, lambda r: r['extra']['update_s']):.2f}"
                     f" + {mean(rs, lambda r: r['extra']['push_s']):.3f}",
                     f"{mean(rs, lambda r: r['extra']['staleness_mean']):.2f}",
                     f"{mean(rs, lambda r: r['extra']['response_len']):.1f}"])
    return markdown_table(["mode", "trained samples/s", "vs sync_disagg", "vs sync_colo", "trained response tokens/s",
                           f"s to {args.target} (runs)", "final accuracy per seed", "CPU utilisation",
                           "wait share of step", "step s = wait + update + push", "staleness mean",
                           "response len"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "bench_async"))
    ap.add_argument("--modes", default="sync_colo,sync_disagg,async_s4,async_s4_shared")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--cap", type=int, default=1024, help="longest response (tokens)")
    ap.add_argument("--target", type=float, default=0.4, help="held-out accuracy for time-to-target")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--override", action="append", default=[], metavar="A.B=C")
    ap.add_argument("--table-only", action="store_true", help="rewrite OUT/table.md from OUT/result.json")
    args = ap.parse_args(argv)
    if args.table_only:
        with open(os.path.join(args.out, "result.json")) as f:
            results = json.load(f)
    else:
        results = run_all(args)
    write_results(args.out, results, summarize(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
