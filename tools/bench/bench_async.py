"""Asynchronous vs synchronous GRPO on a workload shaped like real RL (generation >= 65% of a
synchronous step): trained response tokens/s, the lengths trained, time to a held-out accuracy,
final accuracy, CPU use.

    python tools/bench/bench_async.py [--steps 60] [--seeds 1,2,3] [--target 0.36] [--eval-every 5]
                                      [--modes sync_colo,sync_disagg,async_s4,async_s4_shared]

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

Reported per run: trained response tokens/s and samples/s (evaluation excluded), the trained
response lengths (mean, p50, p90, max, from the run's generations.jsonl: every trained sample),
seconds to --target, final accuracy, how often the staleness hard cap fired
(rollout/regenerated/too_stale), CPU utilisation of the job's whole process tree over its
training window (/proc), the phase times; per mode the mean over seeds and the ratios to both
synchronous baselines (tokens/s: higher is better; time to target: lower). OUT/result.json,
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


def trained_lengths(path: str, train_s: float) -> dict:
    """The response lengths of every trained sample (generations.jsonl) and tokens/s over the
    run's training time."""
    lens = sorted(len(g["versions"]) for g in read_rows(path))
    q = lambda p: lens[min(len(lens) - 1, int(p * len(lens)))]  # noqa: E731
    return {"len_mean": statistics.fmean(lens), "len_p50": q(0.5), "len_p90": q(0.9), "len_max": lens[-1],
            "tokens_per_s": sum(lens) / max(train_s, 1e-9)}


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
            r = run_train(run_dir, overrides + ["logging.dump_generations=true"], f"{mode}/seed{seed}",
                          args.target)
            rows = read_rows(os.path.join(run_dir, "metrics.jsonl"))
            r.extra.update(phase_means(rows))
            r.extra.update(trained_lengths(os.path.join(run_dir, "generations.jsonl"), r.train_s))
            r.extra["too_stale"] = max((x.get("rollout/regenerated/too_stale", 0) for x in rows), default=0)
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
    tok = {m: mean(rs, lambda r: r["extra"]["tokens_per_s"]) for m, rs in by_mode.items()}
    ttt = {m: (statistics.fmean(r["time_to_target_s"] for r in rs)
               if all(r["time_to_target_s"] is not None for r in rs) else None) for m, rs in by_mode.items()}

    def ratio(values: dict, mode: str, base: str) -> str:
        if base not in values or values[mode] is None or not values[base]:
            return "-"
        return f"**{values[mode] / values[base]:.2f}x**"

    rows = []
    for mode, rs in by_mode.items():
        hits = [r["time_to_target_s"] for r in rs if r["time_to_target_s"] is not None]
        e = lambda k: mean(rs, lambda r: r["extra"][k])  # noqa: E731
        rows.append([mode, f"{tok[mode]:.0f}", ratio(tok, mode, "sync_disagg"), ratio(tok, mode, "sync_colo"),
                     f"{statistics.fmean(hits):.1f} ({len(hits)}/{len(rs)})" if hits else f"- (0/{len(rs)})",
                     ratio(ttt, mode, "sync_disagg"), ratio(ttt, mode, "sync_colo"),
                     f"{e('len_mean'):.1f} / {e('len_p50'):.0f} / {e('len_p90'):.0f} / {e('len_max'):.0f}",
                     " / ".join(fmt(r["final_accuracy"]) for r in rs),
                     f"{mean(rs, lambda r: r['samples_per_s']):.1f}",
                     fmt(mean(rs, lambda r: r["extra"].get("cpu_util") or 0.0), ".2f"),
                     fmt(e("gen_share"), ".2f"),
                     f"{e('step_s'):.2f} = {e('wait_s'):.2f} + {e('update_s'):.2f} + {e('push_s'):.3f}",
                     f"{e('staleness_mean'):.2f}", f"{sum(r['extra']['too_stale'] for r in rs):.0f}"])
    return markdown_table(["mode", "trained response tokens/s", "vs sync_disagg", "vs sync_colo",
                           f"s to {args.target} (seeds)", "vs sync_disagg", "vs sync_colo",
                           "trained length mean / p50 / p90 / max", "final accuracy per seed", "trained samples/s",
                           "CPU utilisation", "wait share of step", "step s = wait + update + push",
                           "staleness mean", "regenerated (hard cap)"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "bench_async"))
    ap.add_argument("--modes", default="sync_colo,sync_disagg,async_s4,async_s4_shared")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--cap", type=int, default=1024, help="longest response (tokens)")
    ap.add_argument("--target", type=float, default=0.36, help="held-out accuracy for time-to-target")
    ap.add_argument("--eval-every", type=int, default=5)
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
