"""Benchmark: the same recipe on both rollout engines, side by side - the demo (configs/tiny_grpo.yaml,
unchanged hyperparameters) with its local servers as megarl-server and as real SGLang 0.5.x
(`rollout.engine`, fp32 on CPU with tools/sglang_cpu's settings), each with the weight wire its
servers advertise (megarl-server: direct_bucket + a checksum after every push; SGLang: its own
flattened_bucket, no checksum).

    python tools/bench/bench_engines.py [--steps 60] [--repeats 1] [--sglang-pause abort retract in_place]
                                        [--out runs/bench_engines]

Per engine: median step time, median push (the trainer's `push/total_s`: pause, buckets, the
server's load; `push/stream_s`: the bytes' part), median generation tokens/s
(`throughput/rollout_tokens_per_s`), the step-1 trainer-vs-server logprob gap, held-out accuracy
(500 prompts) at the start and after the last step, process start-up, and the wire preflight
chose (the run's saved config.yaml). SGLang runs once per `--sglang-pause` mode
(`weights.pause_mode`; megarl-server keeps the recipe's). Runs alternate engines (megarl, sglang, megarl, ...), so a
shared machine's load hits both alike. SGLang's CPU path is not what SGLang is built for: read its
numbers as "the loop works against the real server", not as SGLang's speed.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rl_runs import REPO, fmt, markdown_table, read_rows, run_train, write_results  # noqa: E402

def sglang_model(work: str) -> str:
    """The demo model with an HF tokenizer.json (SGLang cannot read sentencepiece); megarl reads
    the same weights and tokenizer.model, so both engines serve identical models."""
    spec = importlib.util.spec_from_file_location(
        "hf_tokenizer", os.path.join(REPO, "tools", "sglang_cpu", "hf_tokenizer.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.hf_model_copy(os.path.join(REPO, "examples", "tiny", "model"), os.path.join(work, "model"))


def median(rows: list[dict], key: str):
    vals = [r[key] for r in rows if r.get("step", 0) >= 1 and isinstance(r.get(key), (int, float))]
    return statistics.median(vals) if vals else None


def one_run(engine: str, model: str, run_dir: str, steps: int, pause: str = "") -> dict:
    summary = run_train(run_dir, [f"model.hf_path={model}", f"rollout.engine={engine}", f"train.steps={steps}",
                                  "rollout.eval_at_start=true", f"rollout.eval_interval={steps}",
                                  "rollout.eval_size=500", "rollout.health_timeout_s=400",
                                  *([f"weights.pause_mode={pause}"] if pause else [])], name=engine)
    rows = read_rows(os.path.join(run_dir, "metrics.jsonl"))
    with open(os.path.join(run_dir, "config.yaml")) as f:
        w = yaml.safe_load(f)["weights"]
    step1 = next(r for r in rows if r.get("step") == 1)
    return {"engine": engine, "wire": f"{w['transport']}/{w['tensor_format']}, verify {w['verify_interval']}, "
                                      f"pause {w['pause_mode']}",
            "step_s": median(rows, "step_time"), "push_s": median(rows, "push/total_s"),
            "stream_s": median(rows, "push/stream_s"), "pause_s": median(rows, "push/pause_s"), "verify_s": median(rows, "time/verify"),
            "gen_tok_s": median(rows, "throughput/rollout_tokens_per_s"),
            "gap_mean": step1.get("mismatch/mean"), "gap_max": step1.get("mismatch/max"),
            "acc0": summary.start_accuracy, "acc1": summary.final_accuracy, "process_s": summary.process_s,
            "steps": summary.steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--sglang-pause", nargs="+", default=["abort", "retract", "in_place"])
    p.add_argument("--out", default=os.path.join(REPO, "runs", "bench_engines"))
    args = p.parse_args()
    model = sglang_model(args.out)
    results = []
    for rep in range(args.repeats):
        runs = [("megarl", "")] + [("sglang", mode) for mode in args.sglang_pause]
        for engine, pause in runs:
            results.append(one_run(engine, model, os.path.join(args.out, f"{engine}{pause}{rep}"), args.steps, pause))
            print(f"[bench] {results[-1]}", flush=True)
    rows = [[r["engine"], r["wire"], fmt(r["step_s"]), fmt(r["push_s"]), fmt(r["pause_s"]), fmt(r["stream_s"]),
             fmt(r["verify_s"]), fmt(r["gen_tok_s"], ".0f"), f"{fmt(r['gap_mean'], '.1e')} / {fmt(r['gap_max'], '.1e')}",
             f"{fmt(r['acc0'])} -> {fmt(r['acc1'])}", fmt(r["process_s"], ".0f")] for r in results]
    md = markdown_table(["engine", "wire (preflight)", "step s", "push s", "pause s", "push stream s", "verify s",
                         "gen tok/s", "step-1 gap mean / max", f"accuracy 0 -> {args.steps}", "process s"], rows)
    write_results(args.out, results, md)


if __name__ == "__main__":
    main()
