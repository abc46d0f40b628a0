"""The HF export schedule the training loops follow (megarl/checkpoint/export.py): every
hf_export_interval steps when set, always at the last step, never without hf_export_dir."""
from types import SimpleNamespace

from megarl.checkpoint import hf_export_due, maybe_export_hf
from megarl.config import CheckpointConfig


def test_interval_and_last_step():
    c = CheckpointConfig(hf_export_dir="/tmp/x", hf_export_interval=20)
    assert [s for s in range(1, 46) if hf_export_due(c, s, last=s == 45)] == [20, 40, 45]


def test_interval_zero_exports_only_at_the_end():
    c = CheckpointConfig(hf_export_dir="/tmp/x")
    assert [s for s in range(1, 6) if hf_export_due(c, s, last=s == 5)] == [5]


def test_no_dir_never_exports():
    c = CheckpointConfig(hf_export_dir="", hf_export_interval=1)
    assert not any(hf_export_due(c, s, last=True) for s in range(1, 4))


def test_maybe_export_hf_calls_the_engine_when_due():
    class Engine:
        def __init__(self):
            self.calls = []

        def export_hf(self, out_dir):
            self.calls.append(out_dir)

    cfg = SimpleNamespace(checkpoint=CheckpointConfig(hf_export_dir="/tmp/out", hf_export_interval=2))
    engine = Engine()
    done = [maybe_export_hf(cfg, engine, s, last=s == 3) for s in (1, 2, 3)]
    assert done == [False, True, True] and engine.calls == ["/tmp/out", "/tmp/out"]


def test_step_template_gives_each_export_its_own_dir():
    class Engine:
        def __init__(self):
            self.calls = []

        def export_hf(self, out_dir):
            self.calls.append(out_dir)

    cfg = SimpleNamespace(checkpoint=CheckpointConfig(hf_export_dir="/tmp/e/step_{step}", hf_export_interval=2))
    engine = Engine()
    for s in (1, 2, 3, 4):
        maybe_export_hf(cfg, engine, s, last=s == 4)
    assert engine.calls == ["/tmp/e/step_2", "/tmp/e/step_4"]
