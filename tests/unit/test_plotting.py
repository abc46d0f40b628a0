"""megarl/common/plotting.py: the learning curve every RL run writes (accuracy and reward vs step and vs
wall time), its wall clock (from the first step's start), and tools/plot_metrics.py --curve."""
import json
import os
import subprocess
import sys

import pytest

from megarl.common.plotting import elapsed, write_learning_curve

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_run(tmp_path):
    rows = [{"step": 0, "time": 99.0, "eval_accuracy": 0.3}]
    rows += [{"step": s, "time": 100.0 + s, "step_time": 1.0, "reward": 0.1 * s} for s in range(1, 6)]
    rows[-1]["eval_accuracy"] = 0.7
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_elapsed_starts_at_the_first_step():
    rows = [{"step": 1, "time": 10.0, "step_time": 2.0}, {"step": 2, "time": 11.0}, {"step": 3}]
    assert elapsed(rows) == [2.0, 3.0, None]


def test_learning_curve_png(tmp_path):
    pytest.importorskip("matplotlib")
    write_run(tmp_path)
    out = write_learning_curve(str(tmp_path))
    assert out == str(tmp_path / "learning_curve.png")
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_nothing_to_plot_is_no_png(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    assert write_learning_curve(str(tmp_path)) is None and not (tmp_path / "learning_curve.png").exists()


def test_plot_metrics_curve_cli(tmp_path):
    pytest.importorskip("matplotlib")
    write_run(tmp_path)
    out = tmp_path / "c.png"
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "plot_metrics.py"),
                    str(tmp_path / "metrics.jsonl"), "--curve", "--out", str(out)], check=True)
    assert out.stat().st_size > 1000
