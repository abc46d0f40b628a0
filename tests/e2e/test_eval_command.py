"""megarl-eval on the tiny demo, against what the trainer's own evaluation reported.

One short RL run (2 steps at a high learning rate, so the weights move: its final greedy accuracy
differs from the start's) evaluates the first 100 held-out prompts at step 0 and after the last
step, dumping every greedy episode. Then megarl-eval scores
  - the HF start model (model.hf_path): no Megatron rank, one local server on the HF dir;
  - the run's latest Megatron checkpoint (eval.checkpoint=latest): exported to HF, then served;
and each must reproduce the trainer's numbers and per-prompt greedy completions exactly (greedy
decoding of the same fp32 weights on the same server code). pass@k is recomputed from the
per-sample dump with the unbiased estimator. Bad input: exit 2, one line naming the field, and no
output written."""
import json
import math
import os
import subprocess
import sys

import pytest

import harness

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = str(harness.TINY)
EVAL_SIZE, K, N = 100, 4, 6
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def base_args(run) -> list[str]:
    return [f"model.hf_path={TINY}/model", f"data.train_path={TINY}/data/rl_prompts.jsonl",
            f"data.eval_path={TINY}/data/eval_prompts.jsonl", f"train.run_dir={run}",
            f"rollout.eval_size={EVAL_SIZE}"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The run dir and the trainer's greedy completions / accuracy at step 0 and at the end.
    Its own run, not a shared one: megarl-eval writes <run_dir>/eval."""
    run = harness.train(tmp_path_factory.mktemp("eval") / "run", f"rollout.eval_size={EVAL_SIZE}",
                        "train.steps=2", "train.global_batch_size=32", "rollout.group_size=4",
                        "rollout.max_staleness=0", "optim.lr=1e-3", "optim.lr_warmup_steps=0",
                        "rollout.eval_at_start=true", "logging.dump_eval_generations=true",
                        "checkpoint.save_interval=0", eval_data=f"{TINY}/data/eval_prompts.jsonl", timeout=300,
                        check=True)
    acc = {r["step"]: r["eval_accuracy"] for r in run.rows if "eval_accuracy" in r}
    done = {}
    for g in run.jsonl("eval_generations.jsonl"):
        done.setdefault(g["step"], {})[g["index"]] = g["completion"]
    assert sorted(acc) == sorted(done) == [0, 2] and all(len(c) == EVAL_SIZE for c in done.values())
    return run.dir, acc, done


def megarl_eval(run, *overrides, recipe=None):
    recipe = recipe or os.path.join(REPO, "configs", "tiny_grpo.yaml")
    return subprocess.run([sys.executable, "-m", "megarl.eval", recipe, *base_args(run), *overrides],
                          capture_output=True, text=True, timeout=300, env=ENV, cwd=str(run.parent))


def read_out(out):
    results = json.loads((out / "results.json").read_text())
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    return results, samples


def check_pass_at_k(results, samples):
    """pass@k and pass@1 recomputed from the dump: per prompt 1 - C(n - c, k) / C(n, k)."""
    by_prompt = {}
    for s in samples:
        if s["kind"] == "sampled":
            by_prompt.setdefault(s["index"], []).append(s["reward"] >= 1.0)
    assert len(by_prompt) == EVAL_SIZE and {len(v) for v in by_prompt.values()} == {N}

    def est(k):
        return sum(1 - math.comb(N - sum(v), k) / math.comb(N, k) for v in by_prompt.values()) / EVAL_SIZE

    assert results[f"pass@{K}"] == pytest.approx(est(K), abs=1e-12)
    assert results["pass@1"] == pytest.approx(est(1), abs=1e-12)
    assert results["pass@1"] <= results[f"pass@{K}"]


def test_hf_model_matches_the_trainers_step_0_evaluation(trained):
    run, acc, done = trained
    out = run.parent / "hf_eval"
    proc = megarl_eval(run, f"eval.out_dir={out}", f"rollout.eval_k={K}", f"eval.n={N}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results, samples = read_out(out)
    assert results["source"] == "hf" and results["prompts"] == EVAL_SIZE and (results["k"], results["n"]) == (K, N)
    # the same number the trainer logged at step 0, from the same completions, prompt by prompt
    assert results["greedy_accuracy"] == acc[0], (results["greedy_accuracy"], acc)
    greedy = {s["index"]: s["completion"] for s in samples if s["kind"] == "greedy"}
    assert greedy == done[0]
    check_pass_at_k(results, samples)
    summary = [x for x in proc.stdout.splitlines() if x.startswith("megarl-eval: ")]
    assert len(summary) == 1 and f"greedy accuracy {acc[0]:.4f}" in summary[0], proc.stdout
    assert "megatron" not in proc.stdout.lower()  # no trainer rank, no Megatron import


def test_checkpoint_matches_the_trainers_final_evaluation(trained):
    run, acc, done = trained
    assert acc[2] != acc[0]  # the weights moved: the two evaluations tell the models apart
    proc = megarl_eval(run, "eval.checkpoint=latest", recipe=str(run / "config.yaml"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results, samples = read_out(run / "eval")  # the default out_dir: <run_dir>/eval
    assert results["source"] == "checkpoint" and results["model"].endswith("step_00000002")
    assert results["greedy_accuracy"] == acc[2], (results["greedy_accuracy"], acc)
    assert {s["index"]: s["completion"] for s in samples if s["kind"] == "greedy"} == done[2]
    assert "k" not in results  # rollout.eval_k 0 in the run's config: greedy only


@pytest.mark.parametrize("override,field", [
    ("eval.checkpoint={run}/no_such_dir", "eval.checkpoint"),
    ("data.eval_path={run}/missing.jsonl", "data.eval_path"),
    ("eval.n=2", "eval.n"),  # fewer samples than rollout.eval_k=4
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(trained, override, field):
    run, _, _ = trained
    out = run.parent / f"bad_{field}"
    proc = megarl_eval(run, override.format(run=run), f"eval.out_dir={out}", f"rollout.eval_k={K}")
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"megarl-eval: {field}: "), proc.stderr
    assert not out.exists()
