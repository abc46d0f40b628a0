"""Several prompt sources (`data.sources`) and several held-out sets (`data.eval_sets`) end to
end: megarl-train on the tiny demo with two sources that score with different rewards (the demo's
exact match, and `half_credit`: 0.5 for the same match), weights 3:1, and two held-out sets of the
same 32 prompts scored by those two rewards at intervals 3 and 2. Every trained sample is scored
by its own source's reward, the draws follow the weights within one prompt, each step reports
each source's share, reward, length and accuracy; each set is evaluated at its own steps, reported
as eval/<name>/..., and drawn as its own line. megarl-eval scores both sets of the start model and
reproduces the run's step-0 numbers."""
import collections
import json
import os
import signal
import subprocess
import sys

import harness

from megarl.common.plotting import eval_set_names

PROMPTS = harness.TINY / "data" / "rl_prompts.jsonl"
HELD_OUT = harness.TINY / "data" / "eval_prompts.jsonl"
MIX = ("data.train_path=", f"data.sources=[{{name: exact, path: {PROMPTS}, weight: 3}}, "
       f"{{name: half, path: {PROMPTS}, weight: 1, reward_fn: 'reward_plugins:half_credit'}}]")
SETS = ("data.eval_path=", "rollout.eval_interval=3", "rollout.eval_size=32", "rollout.eval_at_start=true",
        f"data.eval_sets=[{{name: exact, path: {HELD_OUT}}}, "
        f"{{name: half, path: {HELD_OUT}, interval: 2, reward_fn: 'reward_plugins:half_credit'}}]")


def test_two_sources_and_two_eval_sets(tmp_path):
    run = tmp_path / "run"
    done = harness.train(run, "train.steps=4", "train.global_batch_size=64", "logging.dump_generations=true",
                         "logging.dump_eval_generations=true", *MIX, *SETS, env=harness.plugin_env())
    done.check()
    rows = [r for r in done.rows if r["step"] > 0]  # step 0: the evaluation at start alone
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    samples = [json.loads(line) for line in (run / "generations.jsonl").read_text().splitlines()]
    assert len(samples) == 4 * 64
    rewards = collections.defaultdict(set)
    for s in samples:
        rewards[s["source"]].add(s["reward"])
    # each source's own reward: exact match gives 0/1, half_credit 0/0.5 (the start model is right ~30%)
    assert rewards["exact"] == {0.0, 1.0} and rewards["half"] == {0.0, 0.5}, dict(rewards)
    for r in rows:
        n = {name: round(r[f"source/{name}/trained_share"] * 64) for name in ("exact", "half")}
        assert n["exact"] + n["half"] == 64 and n["exact"] % 8 == 0  # whole groups of 8
        mine = [s for s in samples if s["step"] == r["step"]]
        for name in ("exact", "half"):
            got = [s["reward"] for s in mine if s["source"] == name]
            assert len(got) == n[name] and abs(r[f"source/{name}/reward"] - sum(got) / len(got)) < 1e-12
        # accuracy counts rewards >= 1 (the evaluation's rule): the exact source's reward itself,
        # never reached by half credit
        assert r["source/exact/accuracy"] == r["source/exact/reward"] and r["source/half/accuracy"] == 0.0
        assert r["source/exact/response_len"] > 0 and r["data/exact/total"] == r["data/half/total"] == 5000
    # the draws (trained or still in flight) follow the weights 3:1 within one prompt at any point
    last = rows[-1]
    drawn = last["source/exact/draws"] + last["source/half/draws"]
    assert drawn >= 4 * 8 and abs(last["source/exact/draws"] - 0.75 * drawn) < 1
    assert abs(last["source/exact/draw_share"] - 0.75) <= 1 / drawn
    assert {k for k in last if k.startswith("source/") and k.endswith("filtered_frac")} == \
        {"source/exact/filtered_frac", "source/half/filtered_frac"}

    # held-out sets: each at its own steps (0 with eval_at_start, its interval, the last step)
    evals = [r for r in done.rows if any(k.startswith("eval/") for k in r)]
    measured = {name: [r[f"eval/{name}/step"] for r in evals if f"eval/{name}/step" in r] for name in ("exact", "half")}
    assert measured["exact"][0] == measured["half"][0] == 0 and measured["exact"][-1] == measured["half"][-1] == 4
    assert set(measured["exact"]) <= {0, 3, 4} and set(measured["half"]) <= {0, 2, 4}, measured
    start = evals[0]
    assert start["step"] == 0 and start["eval/exact/n"] == start["eval/half/n"] == 32
    # the first set is the run's eval_accuracy; the same 32 prompts, the same greedy completions:
    # half credit scores exactly half of exact match, and never reaches accuracy (reward >= 1)
    assert start["eval_accuracy"] == start["eval/exact/accuracy"] == start["eval/exact/mean_reward"]
    assert start["eval/half/mean_reward"] == 0.5 * start["eval/exact/accuracy"] and start["eval/half/accuracy"] == 0.0
    assert 0 < start["eval/exact/accuracy"] < 1
    dumped = collections.Counter((g["step"], g["eval_set"]) for g in done.jsonl("eval_generations.jsonl"))
    assert dumped[(0, "exact")] == dumped[(0, "half")] == dumped[(4, "exact")] == dumped[(4, "half")] == 32
    assert eval_set_names(done.rows) == ["exact", "half"]  # one line each in the PNG
    assert (run / "learning_curve.png").stat().st_size > 10_000

    # megarl-eval on the start model: both sets, the run's step-0 numbers
    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "megarl.eval", str(harness.REPO / "configs" / "tiny_grpo.yaml"),
           f"model.hf_path={harness.TINY / 'model'}", f"train.run_dir={tmp_path / 'eval_run'}",
           f"eval.out_dir={out}", *MIX, *SETS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                          env=dict(os.environ, OMP_NUM_THREADS="1", **harness.plugin_env()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert list(results["sets"]) == ["exact", "half"]
    for name in ("exact", "half"):
        assert results["sets"][name]["prompts"] == 32
        assert results["metrics"][f"eval/{name}/accuracy"] == start[f"eval/{name}/accuracy"]
        assert results["metrics"][f"eval/{name}/mean_reward"] == start[f"eval/{name}/mean_reward"]
    assert results["sets"]["half"]["reward_fn"] == "reward_plugins:half_credit"
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert collections.Counter(s["eval_set"] for s in samples) == {"exact": 32, "half": 32}
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("megarl-eval: hf ") and f"exact on {HELD_OUT} (32 prompts)" in line and "; half on " in line



def test_sigkill_and_resume_trains_every_draw_of_the_mixture_exactly_once(tmp_path):
    """test_resume_exactly_once's frame on a mixture: two files of 12 prompts at weights 1:1 (the
    first 24 draws walk each once: global indices 0..23), SIGKILL at step 3, resume from the step-2
    checkpoint: every draw trained once with its whole group, nothing lost, staleness held."""
    from test_resume_exactly_once import OVERRIDES, PROMPTS as N, resume_and_check, until_step

    lines = PROMPTS.read_text().splitlines()
    files = []
    for name, part in (("a", lines[:N // 2]), ("b", lines[N // 2:N])):
        files.append(tmp_path / f"{name}.jsonl")
        files[-1].write_text("\n".join(part) + "\n")
    run_dir = tmp_path / "run"
    args = (*OVERRIDES, "rollout.max_staleness=2", "rollout.staleness_hard_cap=0", "data.train_path=",
            f"data.sources=[{{name: a, path: {files[0]}}}, {{name: b, path: {files[1]}}}]")

    def sigkill_at_step_3(proc):
        until_step(proc, run_dir)
        os.killpg(proc.pid, signal.SIGKILL)

    harness.train(run_dir, *args, during=sigkill_at_step_3, start_new_session=True)
    resume_and_check(run_dir, files[0], *args)
    gens = harness.rows_so_far(run_dir, "generations.jsonl")
    assert {g["source"] for g in gens} == {"a", "b"} and all((g["prompt_index"] < N // 2) == (g["source"] == "a")
                                                              for g in gens)
    last = harness.rows_so_far(run_dir)[-1]
    assert abs(last["source/a/draws"] - last["source/b/draws"]) <= 1 and last["source/a/draws"] >= 9 * 4 // 2

