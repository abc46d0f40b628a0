"""tools/bench/bench_thread_split.py: the recipe it writes is a valid synchronous run of fixed-length
answers, and its ratios are fixed / auto step times and auto / fixed generation rates, per pair."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "tools", "bench"))
bench = pytest.importorskip("bench_thread_split")

from megarl.config import load_config  # noqa: E402


def test_the_generation_heavy_recipe_is_synchronous_with_fixed_answers(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(bench.H512.format(model=tmp_path / "m", data=tmp_path / "d", steps=24))
    cfg = load_config(str(path), [], validate=False)
    assert (cfg.rollout.max_staleness, cfg.rollout.ignore_eos, cfg.rollout.max_new_tokens) == (0, True, 64)
    assert cfg.train.global_batch_size == cfg.rollout.group_size * 8 and cfg.train.steps == 24
    assert cfg.train.torch_threads is None  # the split, unless the fixed side sets 1


def test_ratios_per_pair():
    def run(shape, mode, pair, step, mean, tok):
        return {"shape": shape, "mode": mode, "pair": pair, "step_s": step, "mean_step_s": mean, "update_s": 1.0,
                "wait_s": 1.0, "update_threads": 1, "wait_server_threads": 1, "trainer_idle": 0.3,
                "generated_tok_s": tok, "cpu_util": 0.5}

    md = bench.render([run("a", "fixed", 1, 6.0, 6.0, 500.0), run("a", "auto", 1, 4.0, 5.0, 600.0),
                       run("a", "fixed", 2, 3.0, 3.0, 500.0), run("a", "auto", 2, 3.0, 2.0, 1000.0)])
    assert "| a | 1 | 1.50x | 1.20x | 1.20x |" in md
    assert "| a | 2 | 1.00x | 1.50x | 2.00x |" in md
