"""`megarl-train` against real SGLang (PyPI 0.5.23, fp32, on CPU) that it starts itself
(``rollout.engine=sglang``): the tiny demo recipe, on-policy, held-out evaluation at the start and
at the end. One run serves the module; each test reads what it wrote (metrics.jsonl, the servers'
logs under <run_dir>/servers, what the servers received under <run_dir>/received).

Marker ``sglang``: ``python -m pytest -m sglang`` runs the tier alone, MEGARL_SKIP_SGLANG=1 skips it.
"""
import os

import pytest
import yaml
from sglang_runs import MEGARL_ONLY_PATHS, SGLANG_PATHS, demo_model, load_formats, received, require_sglang, train

pytestmark = pytest.mark.sglang

STEPS = 20
GAP = 1e-5  # mean |logp_trainer - logp_sglang| nats on on-policy tokens, fp32 (measured ~3e-7)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    require_sglang()
    work = tmp_path_factory.mktemp("sglang-train")
    model, run = demo_model(str(work / "model")), str(work / "run")
    # on-policy: every step's tokens come from the weights the step starts from, so each step is gated;
    # the thread split on (auto): the trainer waits for SGLang, which is never asked to change threads
    done = train(run, model, f"train.steps={STEPS}", "rollout.max_staleness=0", "rollout.eval_at_start=true",
                 "train.torch_threads=auto",
                 f"rollout.eval_interval={STEPS}", "rollout.eval_size=500", f"train.mismatch_threshold={GAP}",
                 timeout=1500)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = done.rows
    steps = [r for r in rows if "step_time" in r]
    print(f"\n[sglang-train] {len(steps)} steps in {done.wall_s:.0f} s wall; median step "
          f"{sorted(r['step_time'] for r in steps)[len(steps) // 2]:.2f} s", flush=True)
    return run, rows, done.log


def test_mismatch_gate_passes_at_step_one_within_fp32_gap(run):
    path, rows, _ = run
    first = next(r for r in rows if r.get("step") == 1 and "mismatch/mean" in r)
    print(f"\n[sglang-train] step 1 trainer vs SGLang: mismatch/mean {first['mismatch/mean']:.3g}, "
          f"mismatch/max {first['mismatch/max']:.3g}")
    assert first["mismatch/onpolicy_frac"] == 1.0  # every token gated (max_staleness 0)
    assert 0 < first["mismatch/mean"] <= GAP and first["mismatch/max"] < 1e-3
    # the gate (train.mismatch_threshold=GAP) checked every step and let the run finish
    trained = [r for r in rows if "mismatch/mean" in r]
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
    assert max(r["mismatch/mean"] for r in trained) <= GAP


def test_held_out_accuracy_rises(run):
    _, rows, _ = run
    evals = {r["step"]: r["eval_accuracy"] for r in rows if "eval_accuracy" in r}
    print(f"\n[sglang-train] held-out accuracy (500 prompts, greedy on SGLang): {evals}")
    assert sorted(evals) == [0, STEPS], evals
    assert 0.15 <= evals[0] <= 0.45, evals  # the demo start point (examples/tiny/sft_eval.json)
    # 500 prompts: one accuracy's standard error is <= 0.023, so +0.08 is a real rise (the demo row of
    # test_recipes_learn.py)
    assert evals[STEPS] >= evals[0] + 0.08, evals


def test_servers_received_only_sglang_endpoints_and_load_formats(run):
    path, _, log = run
    # the split ran, and left SGLang's threads alone (/set_threads is megarl-server's: MEGARL_ONLY_PATHS)
    assert "server threads while the trainer waits - -> 1: the servers' count is fixed" in log
    got = received(path)
    assert list(got) == ["server0.log"], got
    paths = {key.split()[1] for key in got["server0.log"]}
    assert paths <= SGLANG_PATHS | {"/freeze_gc"}, paths - SGLANG_PATHS  # /freeze_gc: SGLang calls it on itself at start
    assert not paths & MEGARL_ONLY_PATHS
    assert {"/generate", "/update_weights_from_distributed", "/pause_generation"} <= paths
    failed = {k: n for k, n in got["server0.log"].items() if k.split()[2][0] in "45" and k != "GET /health 503"}
    assert not failed, failed  # 503 on /health only while it starts
    # STEPS pushes plus the initial one, each answered 200
    assert got["server0.log"]["POST /update_weights_from_distributed 200"] == STEPS + 1
    formats = load_formats(path)  # SGLang's own flattened bucket, chosen from its /model_info
    assert formats == {"/update_weights_from_distributed": {"flattened_bucket"}, "/init_weights_update_group": {None},
                       "/destroy_weights_update_group": {None}}, formats
    with open(os.path.join(path, "config.yaml")) as f:
        weights = yaml.safe_load(f)["weights"]
    assert (weights["tensor_format"], weights["verify_interval"], weights["pause_mode"]) == ("sglang", 0, "retract")


def test_junk_server_args_are_refused_by_sglangs_own_parser():
    """rollout.server_args that SGLang's parser refuses stop megarl-train at preflight (one line,
    before any rank, server or run directory), checked by SGLang's own argparse in its venv."""
    from megarl.common.errors import ConfigError
    from megarl.config import load_config
    from megarl.launch.preflight import check_server_args

    require_sglang()
    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny_grpo.yaml"),
                      ["rollout.engine=sglang", "rollout.server_args=[--tp-size,two]"])
    with pytest.raises(ConfigError) as e:
        check_server_args(cfg)
    assert str(e.value) == ("rollout.server_args: --tp-size two: sglang.launch_server: argument "
                            "--tp-size/--tensor-parallel-size: invalid int value: 'two'")
