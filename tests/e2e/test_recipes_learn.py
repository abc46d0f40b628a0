"""The learning recipes, one table: each row is a shortened `megarl-train configs/<recipe>` on the
tiny demo (same model, same hyperparameters, fewer steps), the overrides that make it, and what
the run must show - held-out greedy accuracy over 500 prompts risen by at least `rise` above its
start, plus the row's own checks. Each (row, check) is a test; a row's checks all read one run
(`shared_train`), made the first time one of them asks. No timing assertions: the machine is shared.

The step-0 evaluation. The demo, LoRA, reward-model and colocated rows all start from the same
policy (examples/tiny/model; LoRA's B = 0 leaves it unchanged) and evaluate it greedily on the
same 500 held-out prompts with the same exact-match reward, so their step-0 accuracy is one
number: the demo run measures it (rollout.eval_at_start) and the other three read it from there
(`base: "demo"`) instead of recomputing it (measured 0.296 in each: examples/tiny/sft_eval.json,
docs/tasks.md, docs/benchmarks.md). Each rise is still a paired difference of the same prompts at
both ends. That a recipe's step-0 policy is the base is checked where it can break: LoRA at init
equals the frozen base exactly (tests/dist/test_lora_dist.py), the colocated server starts
on-policy (its `on_policy` check). The MoE row starts from another model and measures its own.
Running a `base: "demo"` row alone runs the demo row's run too.

Long-tailed asynchrony (the last rows) compares two runs instead of a start and an end: an
asynchronous run trains the same response lengths as a synchronous one."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import statistics
import time
from typing import Callable

import pytest

import harness

EVAL = harness.TINY / "data" / "eval_prompts.jsonl"


def learning(steps: int, own_start: bool) -> tuple[str, ...]:
    """`steps` RL steps, the 500-prompt held-out evaluation after the last one, and at step 0 when
    the row measures its own start."""
    return (f"train.steps={steps}", f"rollout.eval_interval={steps}", "rollout.eval_size=500",
            f"rollout.eval_at_start={str(own_start).lower()}")


@dataclasses.dataclass
class Case:
    """One row: `recipe` with `overrides`, `steps` RL steps; held-out accuracy at the last step
    >= start + `rise`, where the start is the run's own step 0 (`base` "own") or the demo's (`base`
    "demo", see the module docstring); `start` checks that start value; `checks` read the run."""

    id: str
    recipe: str
    steps: int
    overrides: tuple[str, ...]
    rise: float | None = None
    base: str = "demo"
    start: Callable[[float], bool] | None = None
    checks: tuple[Callable, ...] = ()
    kw: dict = dataclasses.field(default_factory=dict)  # harness.train's model, eval_data, timeout, during

    def args(self) -> tuple[tuple[str, ...], dict]:
        return self.overrides, {"recipe": self.recipe, **self.kw}


class Recipes:
    """The table's runs for one test: `run(case)` is that row's shared run, exited 0."""

    def __init__(self, shared_train, models: pathlib.Path):
        self.shared_train, self.models = shared_train, models

    def run(self, case: Case) -> harness.Run:
        overrides, kw = case.args()
        if callable(kw.get("model")):  # a model made for the row, once per session
            kw["model"] = kw["model"](self.models)
        run = self.shared_train(*overrides, **kw)
        assert run.returncode == 0, (f"the {case.id} run: exit {run.returncode}\n{run.stdout[-2000:]}\n"
                                     f"{run.stderr[-4000:]}")
        return run

    def base_eval(self) -> float:
        """The demo run's step-0 held-out accuracy: the start of every `base: "demo"` row."""
        evals = {r["step"]: r["eval_accuracy"] for r in self.run(DEMO).rows if "eval_accuracy" in r}
        return evals[0]


@pytest.fixture(scope="module")
def recipes(shared_train, tmp_path_factory):
    return Recipes(shared_train, tmp_path_factory.mktemp("recipe_models"))


def held_out_rise(case: Case, run: harness.Run, recipes: Recipes) -> None:
    """Held-out greedy accuracy at the last step >= start + case.rise (500 prompts, greedy, the
    same prompts at both ends: a paired difference)."""
    evals = {r["step"]: r["eval_accuracy"] for r in run.rows if "eval_accuracy" in r}
    if case.base == "own":
        assert sorted(evals) == [0, case.steps], evals
        start = evals[0]
    else:
        assert sorted(evals) == [case.steps], evals  # step 0 is the demo run's (module docstring)
        start = recipes.base_eval()
    print(f"\n[{case.id}] held-out accuracy {start:.3f} -> {evals[case.steps]:.3f} in {case.steps} steps")
    assert evals[case.steps] >= start + case.rise, (start, evals)
    if case.start is not None:
        assert case.start(start), (start, evals)


# ---- demo ----------------------------------------------------------------------------------------

def demo_start(acc: float) -> bool:
    return 0.15 <= acc <= 0.45  # the demo start point (examples/tiny/sft_eval.json)


def learning_curve_png(case, run, recipes):
    """The run writes the learning-curve PNG (when matplotlib is installed)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (run.dir / "learning_curve.png").stat().st_size > 1000


# 500 held-out prompts: the standard error of one accuracy is <= 0.023, so +0.08 is a real rise
DEMO = Case("demo", "tiny_grpo.yaml", 60, learning(60, own_start=True), rise=0.08, base="own", start=demo_start,
            checks=(learning_curve_png,), kw={"eval_data": EVAL, "timeout": 900})


# ---- LoRA ----------------------------------------------------------------------------------------

def only_adapters_pushed(case, run, recipes):
    """Only the adapters moved: every step's push is the adapters' size, a fraction of the model's,
    so the rise comes from them."""
    steps = [r for r in run.rows if r["step"] >= 1]
    assert [r["step"] for r in steps] == list(range(1, case.steps + 1))
    model_bytes = os.path.getsize(harness.TINY / "model" / "model.safetensors")
    for r in steps:
        assert r["optimizer_steps"] == 1 and r["grad_norm"] > 0, r
    # pushes overlapped with the next update (weights.overlap, staleness 1): a step reports the push
    # that landed in it
    landed = [r for r in steps if "push/version" in r]
    assert len(landed) >= case.steps // 2, [r["step"] for r in landed]
    for r in landed:
        assert r["push/bytes"] == r["push/adapter_bytes"] < model_bytes / 4, r


# 40 steps sat at the knee of the curve: 2 of ~12 runs there (one in a clean-clone CI run) ended at
# 0.306, while the others rose +0.09..+0.16; 70 steps are past it: +0.166, +0.180, +0.178 (28-31 s,
# quiet machine). Measured in 40 steps on the 2-core machine shared with a CI run (load average
# 6-28): +0.128, +0.124, +0.126, +0.140, +0.114 (50 steps: +0.130); with optim.lr=1e-9 the same 40
# steps give +0.000. The rise is a paired difference, whose standard error is ~sqrt(flipped/500),
# ~0.016-0.02 when 13-20% of answers flip, so 0.06 sits ~3 standard errors from both 0 and +0.114
LORA = Case("lora", "tiny_grpo_lora.yaml", 70, ("checkpoint.save_interval=0", *learning(70, own_start=False)),
            rise=0.06, start=demo_start, checks=(only_adapters_pushed,), kw={"eval_data": EVAL})


# ---- MoE -----------------------------------------------------------------------------------------

def moe_start(acc: float) -> bool:
    return abs(acc - 0.274) <= 0.03  # the start point (examples/tiny_moe/sft_eval.json)


def router_load_balancing_loss(case, run, recipes):
    """The router's load-balancing loss is reported every step, within the Switch loss's range."""
    aux = [r["moe_aux_loss"] for r in run.rows if r.get("step", 0) >= 1 and "loss" in r]
    assert len(aux) == case.steps
    # Switch loss: 1 when the 4 experts share tokens and probability evenly, at most E/k = 2 (one
    # expert takes a slot of every token and all the probability); measured 1.07..1.22 over 335 steps
    assert all(1.0 <= a < 1.5 for a in aux), aux


# The SFT'd tiny Qwen3-MoE of examples/tiny_moe, served by the local CPU rollout server, trained
# through Megatron's MoE layers with the load-balancing loss on. Measured rises after 60 steps,
# rollout.seed / train.seed 0/1234, 1/1235, 2/1236: +0.104, +0.100, +0.100 (docs/models.md "MoE RL");
# +0.05 keeps half of the smallest as margin, and is over 2 standard errors of one 500-prompt accuracy
MOE = Case("moe", "tiny_moe_grpo.yaml", 60, (*learning(60, own_start=True), "rollout.seed=0",
                                              "checkpoint.save_interval=0"),
           rise=0.05, base="own", start=moe_start, checks=(router_load_balancing_loss,),
           kw={"model": harness.TINY_MOE / "model", "eval_data": EVAL, "timeout": 900})


# ---- reward model --------------------------------------------------------------------------------

def kill_reward_server_at_step_10(proc) -> dict | None:
    """Kills the job's reward-model server once training is under way (step 10 logged); returns
    its servers.json entry (Run.probe), None when the run ended first."""
    run = harness.run_dir_of(proc)
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if any(r.get("step", 0) >= 10 and "reward" in r for r in harness.rows_so_far(run)):
            killed = json.loads((run / "reward_servers" / "servers.json").read_text())[0]
            os.kill(killed["pid"], signal.SIGKILL)
            return killed
        time.sleep(0.2)
    return None


def killed_reward_server_is_restarted(case, run, recipes):
    """The job restarts its killed reward-model server on its own port, RewardModel's retries
    cover the gap, no reward call fails; the training reward is the model's score."""
    killed = run.probe
    assert killed is not None, "the run ended before step 10"
    rows = run.rows
    last = [r for r in rows if "reward/server_restarts" in r][-1]
    assert last["reward/server_restarts"] >= 1, last
    assert last["reward/errors"] == 0 and last["reward/timeouts"] == 0, last
    now = json.loads((run.dir / "reward_servers" / "servers.json").read_text())[0]
    assert now["url"] == killed["url"] and now["pid"] != killed["pid"]  # same port, a new process
    # the reward is the model's score, not exact match: the training reward is not in {0, 1}
    assert any(r.get("reward") not in (None, 0.0, 1.0) for r in rows)


# The demo policy trained from the tiny reward model alone (examples/tiny/reward_model, served by a
# megarl-server the job starts: reward.model); held-out accuracy is still exact match. Measured in
# 60 steps: +0.048, +0.110, +0.098, +0.096, +0.066 (docs/tasks.md), then +0.086, +0.126 and once
# +0.020 (a run of the two-worker suite: asynchronous, so which samples are one version stale and
# how the server batches them move with the machine's load): 100 steps, +0.106 measured under the
# same load. The rise is a paired difference, whose standard error is ~sqrt(flipped / 500) ~ 0.015
# when ~12% of answers flip
RM = Case("rm", "tiny_grpo_rm.yaml", 100,
          (f"reward.model.path={harness.TINY / 'reward_model'}", "checkpoint.save_interval=0",
           *learning(100, own_start=False), "reward.model.health_interval_s=0.5"),
          rise=0.03, start=demo_start, checks=(killed_reward_server_is_restarted,),
          kw={"eval_data": EVAL, "timeout": 1500, "during": kill_reward_server_at_step_10})


# ---- colocated -----------------------------------------------------------------------------------

SLEEP_LOG = re.compile(r"(release|resume)_memory_occupation (\S+) at ([0-9.]+); weight bytes so far: "
                       r"socket (\d+), shared memory (\d+)")


def _server_events(run) -> list[re.Match]:
    return [m for m in map(SLEEP_LOG.search, (run.dir / "servers" / "server0.log").read_text().splitlines()) if m]


def server_sleeps_through_every_update(case, run, recipes):
    """Every step the server is put to sleep before the update starts and woken after it ends
    (the server's own log and clock against the trainer's timeline)."""
    events = [(m[1], m[2], float(m[3])) for m in _server_events(run)]
    sleeps = [t for kind, _, t in events if kind == "release"]
    wakes = [t for kind, _, t in events if kind == "resume"]
    assert len(sleeps) == len(wakes) == case.steps, events[:4]
    assert all(tags == "kv_cache,weights" for _, tags, _ in events)
    updates = [(u["start"], u["end"]) for u in run.timeline() if u["name"] == "update"]
    assert len(updates) == case.steps
    for (start, end), asleep, awake in zip(updates, sleeps, wakes):
        assert asleep <= start and end <= awake, (asleep, start, end, awake)  # the server's own clock


def no_weight_byte_crosses_a_socket(case, run, recipes):
    last = _server_events(run)[-1]
    assert int(last[4]) == 0  # every push went through /dev/shm
    assert int(last[5]) >= case.steps * 2_300_000 * 0.9  # the tiny model's 2.3 MB, at least once per push


def on_policy(case, run, recipes):
    rows = run.rows
    first = next(r for r in rows if r["step"] == 1)
    assert first["mismatch/onpolicy_frac"] == 1.0 and first["mismatch/mean"] <= 1e-4, first
    assert all(r["staleness_max"] == 0 for r in rows if r["step"] >= 1)


# `rollout.placement: colocated` on CPU (seed 004's hybrid engine): megarl-train starts its
# megarl-server on the same cores and, every step, wakes it, hands the weights over through shared
# memory, lets it generate, puts it to sleep and trains. The SIGKILL + resume of a colocated run is
# test_resume_exactly_once.py's colocated case. 500 prompts: SE ~0.021 per accuracy.
COLOCATED = Case("colocated", "tiny_grpo.yaml", 40,
                 ("train.global_batch_size=128", *learning(40, own_start=False), "rollout.placement=colocated",
                  "rollout.max_staleness=0", "weights.transport=shm", "logging.timeline=true"),
                 rise=0.04, checks=(server_sleeps_through_every_update, no_weight_byte_crosses_a_socket, on_policy),
                 kw={"eval_data": EVAL, "timeout": 900})


# ---- long-tailed asynchrony ----------------------------------------------------------------------
# `LongTailWorkflow`: every sample gets its own budget, P(len > x) = 4 / x on [4, 512] tokens,
# generated to exactly that length (`rollout.ignore_eos`), from the same (prompt, draw) -> budget
# table in both runs. Synchronous: on-policy, no partial rollouts. Asynchronous: max_staleness 2,
# partial rollouts kept in place across pushes (long groups span several versions), the default
# staleness rule (bound at the start, hard cap 64), two optimizer steps per RL step and
# `algo.prox_logp_mode: metrics`, which recomputes log pi_prox and reports how far the loglinear
# approximation is from it - on samples that span versions.
# Tolerance: the mean trained response length within 10% of the synchronous run's (the issue's
# target), p50 and p90 within 25% (quantiles of a Pareto tail over ~600 samples move more).
# Measured: 25.6 / 25.6 tokens (p50 8 / 8, p90 48 / 48, max 512 / 512); the strict rule
# (`rollout.staleness_hard_cap=0`, the old behaviour) fails it: 25.6 / 15.8 tokens, p90 48 / 35,
# max 512 / 180, and it regenerates groups for their age.
CAP, LONG_STEPS = 512, 20


def long_context_model(models: pathlib.Path) -> str:
    """The demo's model with room for CAP-token answers (RoPE: no position table to grow)."""
    dst = models / "long_context"
    if not dst.exists():
        shutil.copytree(harness.TINY / "model", dst)
        config = json.loads((dst / "config.json").read_text())
        config["max_position_embeddings"] = CAP + 16
        (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def _long_tail(*extra: str) -> tuple[str, ...]:
    return ("checkpoint.save_interval=0", f"train.steps={LONG_STEPS}", "train.global_batch_size=32",
            "rollout.group_size=4", "rollout.workflow=megarl.rollout.workflows:LongTailWorkflow",
            "rollout.workflow_args={min_new_tokens: 4, alpha: 1.0, seed: 3}", "rollout.ignore_eos=true",
            f"rollout.max_new_tokens={CAP}", f"train.max_seq_len={CAP + 16}", "train.micro_batch_tokens=1024",
            "rollout.eval_at_start=false", "logging.dump_generations=true", *extra)


def quantile(xs: list[int], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q * 100) - 1]


def _trained(run) -> list[dict]:
    return [r for r in run.rows if "step" in r and "response_len" in r]


def trains_the_lengths_a_synchronous_run_trains(case, run, recipes):
    s = [len(g["versions"]) for g in recipes.run(LONG_TAIL_SYNC).generations]
    a = [len(g["versions"]) for g in run.generations]
    rows = _trained(run)
    assert len(s) == len(a) == LONG_STEPS * 32
    print(f"trained response length, sync vs async: mean {statistics.fmean(s):.1f} / "
          f"{statistics.fmean(a):.1f}, p50 {quantile(s, .5):.0f} / {quantile(a, .5):.0f}, "
          f"p90 {quantile(s, .9):.0f} / {quantile(a, .9):.0f}, max {max(s)} / {max(a)}")
    assert abs(statistics.fmean(a) / statistics.fmean(s) - 1) <= 0.10
    for q in (0.5, 0.9):
        assert abs(quantile(a, q) / quantile(s, q) - 1) <= 0.25, q
    # the run was asynchronous: long groups were trained across versions, none regenerated
    assert max(r["staleness_max"] for r in rows) >= 2
    assert sum(len(set(g["versions"])) > 1 for g in run.generations) > 0
    assert rows[-1]["rollout/regenerated/too_stale"] == 0


def loglinear_prox_holds_on_samples_that_span_versions(case, run, recipes):
    spanning = [r for r in _trained(run) if r.get("partial_frac", 0) > 0 and r["prox_behave_abs_gap"] > 0]
    assert spanning, "no step trained a sample that spans versions"
    print("loglinear error / no-approximation error per step:",
          " ".join(f"{r['prox_approx_abs_err']:.2e}/{r['prox_behave_abs_gap']:.2e}" for r in spanning))
    # over the run the loglinear interpolation is several times closer to the recomputed
    # log pi_prox than pi_behave is (measured: 0.13-0.19 of the gap). Per step it is no worse than
    # the gap by more than noise: at a step where only a few tokens span a push the two are about
    # equal (measured 2.12e-2 vs 2.10e-2 in one CI run), so the bound there is 1.25x, not 1x.
    for r in spanning:
        assert r["prox_approx_abs_err"] < 1.25 * r["prox_behave_abs_gap"], r
    ratio = sum(r["prox_approx_abs_err"] for r in spanning) / sum(r["prox_behave_abs_gap"] for r in spanning)
    assert ratio <= 0.3, ratio


LONG_TAIL_SYNC = Case("long_tail_sync", "tiny_grpo.yaml", LONG_STEPS,
                      _long_tail("rollout.max_staleness=0", "rollout.partial_rollout=false"),
                      kw={"model": long_context_model, "timeout": 900})  # the reference: no checks of its own
LONG_TAIL_ASYNC = Case("long_tail_async", "tiny_grpo.yaml", LONG_STEPS,
                       _long_tail("rollout.max_staleness=2", "rollout.partial_rollout=true",
                                  "weights.pause_mode=in_place", "algo.prox_logp_mode=metrics",
                                  # two optimizer steps per RL step: at the second, pi_theta has moved
                                  # past pi_prox and loglinear interpolates (at the first it equals
                                  # the recompute exactly)
                                  "train.ppo_mini_batch_size=16"),
                       checks=(trains_the_lengths_a_synchronous_run_trains,
                               loglinear_prox_holds_on_samples_that_span_versions),
                       kw={"model": long_context_model, "timeout": 900})


# ---- the table -----------------------------------------------------------------------------------

CASES = [DEMO, LORA, MOE, RM, COLOCATED, LONG_TAIL_ASYNC]  # the demo first: it measures the shared step 0
TESTS = [(case, check) for case in CASES
         for check in ((held_out_rise,) if case.rise is not None else ()) + case.checks]


@pytest.mark.parametrize("case,check", TESTS, ids=[f"{c.id}-{f.__name__}" for c, f in TESTS])
def test_recipe(case, check, recipes):
    check(case, recipes.run(case), recipes)
