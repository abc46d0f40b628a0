"""The cores a step leaves idle, put to work: `train.torch_threads: auto` against one fixed thread
per side, on runs whose generation is expensive (issue 46 item 2).

    python tools/bench/bench_thread_split.py [--steps 24] [--pairs 2] [--out runs/bench_threads]

Shapes (each run alone on the machine; fixed and auto alternate, pair after pair):

    h512-sync   a 12.9M-parameter char-level Llama (hidden 512, 4 layers, MLP 1408; random weights,
                written by this script), synchronous GRPO (rollout.max_staleness 0) of 8 prompts x 8
                samples, every answer 64 tokens (ignore_eos): the trainer waits while the server
                generates, the server idles while the trainer updates.
    demo-sync   the demo's model and prompts, synchronous, 64 answers of 24 tokens a step (the
                shape of tests/e2e/test_thread_split_run.py).

The random model's rewards are all equal (no learning): this measures throughput, not accuracy,
and the answers' lengths are fixed so both sides do the same work. fixed: ``train.torch_threads=1``
(the trainer one thread, the server its one); auto: the split of megarl/trainer/threads.py, whose
trial windows take the first 16 steps. Reported per run: median step time after the windows,
mean step time over every step (the trials included), generated tokens/s over the training
window, the phases' medians and the machine's busy share; the auto/fixed ratios of each pair.
Results: OUT/result.json and OUT/table.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_tail_vs_trl import make_tokenizer, sample_rows, write_jsonl  # noqa: E402
from rl_runs import fmt, markdown_table, read_rows, run_train, write_results  # noqa: E402

WINDOWS = 16  # the split's two trial windows (megarl.trainer.threads: 2 x TRIALS steps)

H512 = """# written by tools/bench/bench_thread_split.py: synchronous GRPO, fixed 64-token answers
model:
  hf_path: {model}
  init: hf
train:
  algorithm: rl
  steps: {steps}
  global_batch_size: 64
  micro_batch_tokens: 8192
  max_seq_len: 96
data:
  train_path: {data}/rl_prompts.jsonl
optim:
  lr: 1.0e-5
algo:
  policy_loss: decoupled_ppo
  prox_logp_mode: loglinear
  advantage: grpo
rollout:
  local_servers: 1
  group_size: 8
  max_new_tokens: 64
  ignore_eos: true
  max_staleness: 0
  max_concurrent: 64
checkpoint:
  save_interval: 0
logging:
  log_interval: 1
"""

SHAPES = {
    "h512-sync": lambda a: (os.path.join(a.out, "assets", "h512_sync.yaml"), []),
    "demo-sync": lambda a: ("configs/tiny_grpo.yaml", [
        "rollout.max_staleness=0", "rollout.max_new_tokens=24", "rollout.ignore_eos=true",
        "train.global_batch_size=64", "checkpoint.save_interval=0", "logging.log_interval=1", "data.eval_path="]),
}


def make_assets(out: str, steps: int) -> None:
    """OUT/assets: the random hidden-512 char-level Llama, its tokenizer, the countdown prompts and
    the recipe."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model, data = os.path.join(out, "assets", "h512"), os.path.join(out, "assets", "data")
    os.makedirs(model, exist_ok=True)
    os.makedirs(data, exist_ok=True)
    write_jsonl(os.path.join(data, "rl_prompts.jsonl"), sample_rows(5000, 1))
    make_tokenizer(model)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, head_dim=64, max_position_embeddings=192,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(config).save_pretrained(model, safe_serialization=True)
    with open(os.path.join(out, "assets", "h512_sync.yaml"), "w") as f:
        f.write(H512.format(model=model, data=data, steps=steps))


def one_run(args, shape: str, mode: str, pair: int) -> dict:
    config, overrides = SHAPES[shape](args)
    run_dir = os.path.join(args.out, f"{shape}-{mode}-{pair}")
    threads = "train.torch_threads=1" if mode == "fixed" else "train.torch_threads=auto"
    extra = [] if shape != "h512-sync" else [f"data.train_path={args.out}/assets/data/rl_prompts.jsonl"]
    s = run_train(run_dir, [*overrides, *extra, f"train.steps={args.steps}", threads, "data.eval_path="],
                  f"{shape}-{mode}-{pair}", config=config)
    rows = [r for r in read_rows(os.path.join(run_dir, "metrics.jsonl")) if r["step"] >= 1]
    after = [r for r in rows if r["step"] > WINDOWS + 1] or rows
    med = lambda key, rs=after: statistics.median(r.get(key, 0.0) for r in rs)  # noqa: E731
    generated = rows[-1]["rollout/tokens"]
    return {"shape": shape, "mode": mode, "pair": pair, "steps": len(rows),
            "step_s": med("step_time"), "mean_step_s": s.train_s / len(rows),
            "update_s": med("time/update"), "wait_s": med("time/wait"),
            # fixed: one thread each (train.torch_threads=1, rollout.server_threads 1), not reported per step
            "update_threads": med("trainer/update_threads") if mode == "auto" else 1,
            "wait_server_threads": med("trainer/wait_server_threads") if mode == "auto" else 1,
            "trainer_idle": med("trainer_idle_ratio", rows), "generated_tok_s": generated / s.train_s,
            "cpu_util": s.extra.get("cpu_util")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "bench_threads"))
    ap.add_argument("--steps", type=int, default=24, help="steps per run (the first 16 are auto's trials)")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args(argv)
    if args.steps <= WINDOWS + 1:
        ap.error(f"--steps must be more than {WINDOWS + 1}: the split's trial windows take the first {WINDOWS}")
    args.out = os.path.abspath(args.out)
    make_assets(args.out, args.steps)
    results = []
    for shape in args.shapes:
        for pair in range(1, args.pairs + 1):
            for mode in ("fixed", "auto"):
                r = one_run(args, shape, mode, pair)
                print(f"[bench] {r}", flush=True)
                results.append(r)
    write_results(args.out, results, render(results))
    return 0


def render(results: list[dict]) -> str:
    """The runs' table and the pairs' auto/fixed ratios (markdown)."""
    table, ratios = [], []
    for r in results:
        table.append([r["shape"], r["mode"], r["pair"], fmt(r["step_s"]), fmt(r["mean_step_s"]), fmt(r["update_s"]),
                      fmt(r["wait_s"]), f"{r['update_threads']:g} / {r['wait_server_threads']:g}",
                      fmt(r["trainer_idle"], ".2f"), fmt(r["generated_tok_s"], ".0f"), fmt(r["cpu_util"], ".0%")])
        if r["mode"] == "auto":
            base = next(x for x in results
                        if (x["shape"], x["pair"], x["mode"]) == (r["shape"], r["pair"], "fixed"))
            ratios.append([r["shape"], r["pair"], fmt(base["step_s"] / r["step_s"], ".2f") + "x",
                           fmt(base["mean_step_s"] / r["mean_step_s"], ".2f") + "x",
                           fmt(r["generated_tok_s"] / base["generated_tok_s"], ".2f") + "x"])
    md = markdown_table(["shape", "threads", "pair", "step s (after trials, median)", "step s (mean, all)",
                         "update s", "wait s", "update / server-while-waiting threads", "trainer idle",
                         "generated tok/s", "machine busy"], table)
    md += "\n\n" + markdown_table(["shape", "pair", "fixed / auto step (after trials)", "fixed / auto step (all)",
                                   "auto / fixed generated tok/s"], ratios)
    return md


if __name__ == "__main__":
    sys.exit(main())
