"""The run's weight wire in one value (`megarl.protocol.wire_plan.WirePlan`): decided once from the
resolved weights section and the run's shape, saved as <run_dir>/wire.json by megarl-train's rank
0, read back by the rollout manager the job starts; the pusher builds its transport from it."""
import os
import stat

import pytest

from megarl.config import WeightSyncConfig, load_config
from megarl.protocol.wire_plan import WIRE_FILE, WirePlan


def _w(**fields):
    base = {"tensor_format": "megarl", "pause_mode": "abort", "verify_interval": 10}
    return WeightSyncConfig(**{**base, **fields})


# (weights fields, colocated, asynchronous, lora rank) -> (tensor_format, adapters, overlap)
CASES = [
    ({}, False, True, 0, ("megarl", "none", True)),
    ({}, False, False, 0, ("megarl", "none", False)),  # staleness 0: synchronous
    ({"overlap": False}, False, True, 0, ("megarl", "none", False)),  # the user's choice
    ({}, True, True, 0, ("megarl", "none", False)),  # colocated: synchronous
    ({"transport": "disk"}, False, True, 0, ("megarl", "none", False)),  # whole checkpoints
    ({"refit": "shard"}, False, True, 0, ("megarl", "none", False)),  # no buckets
    ({"transport": "shm"}, False, True, 0, ("megarl", "none", True)),
    ({"tensor_format": "sglang"}, False, True, 8, ("sglang", "peft", False)),  # PEFT dirs: a collective export
    ({}, False, True, 8, ("megarl", "merged", True)),  # megarl-server merges pushed adapters
    ({"tensor_format": "sglang", "transport": "tensor"}, True, False, 0, ("sglang_ipc", "none", False)),
    ({"tensor_format": "sglang", "transport": "tensor"}, False, True, 0, ("sglang", "none", True)),
    ({"tensor_format": "sglang"}, True, False, 0, ("sglang", "none", False)),  # distributed: bytes, not IPC
]


@pytest.mark.parametrize("fields,colocated,asynchronous,rank,want", CASES)
def test_decided_from_the_resolved_section_and_the_run_shape(fields, colocated, asynchronous, rank, want):
    w = _w(**fields)
    plan = WirePlan.decide(w, colocated, asynchronous, rank)
    assert (plan.tensor_format, plan.adapters, plan.overlap) == want
    assert (plan.transport, plan.refit, plan.pause_mode, plan.verify_every) == (w.transport, w.refit, "abort", 10)
    assert plan.peft == (want[1] == "peft")


@pytest.mark.parametrize("field,fields", [("tensor_format", {"tensor_format": "auto"}),
                                          ("pause_mode", {"pause_mode": "auto"}),
                                          ("verify_interval", {"verify_interval": None})])
def test_an_unresolved_field_is_named(field, fields):
    with pytest.raises(ValueError, match=f"^weights.{field}: auto was not resolved against the servers"):
        WirePlan.decide(_w(**fields))


def test_saved_and_read_back_exactly(tmp_path):
    plan = WirePlan.decide(_w(transport="tensor", tensor_format="sglang", pause_mode="retract"), True, False, 0)
    path = plan.save(str(tmp_path))
    assert path == str(tmp_path / WIRE_FILE) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert WirePlan.load(str(tmp_path)) == plan
    assert not os.path.exists(path + ".tmp")
    assert plan.describe() == ("tensor, sglang_ipc format, adapters none, pause retract, checksums every 10 pushes, "
                               "synchronous pushes")
    assert WirePlan.load(str(tmp_path / "none")) is None


def test_save_never_writes_through_a_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.symlink(victim, tmp_path / (WIRE_FILE + ".tmp"))
    WirePlan().save(str(tmp_path))
    assert victim.read_text() == "keep" and WirePlan.load(str(tmp_path)) == WirePlan()


@pytest.mark.parametrize("text", ["{", "[1]", '{"transport": "tensor"}'])
def test_a_file_that_is_no_plan_is_named(tmp_path, text):
    (tmp_path / WIRE_FILE).write_text(text)
    with pytest.raises(ValueError, match=f"^{tmp_path / WIRE_FILE}: not a weight wire plan"):
        WirePlan.load(str(tmp_path))


def test_the_manager_reads_what_the_trainer_saved(tmp_path):
    """`ManagerSpec.from_config` (the manager process) takes the saved plan, not its own guess: the
    trainer's preflight is what resolved the wire against the servers."""
    from megarl.rollout.manager import ManagerSpec

    run = tmp_path / "run"
    cfg = load_config(None, ["model.hf_path=/m", f"train.run_dir={run}", "weights.tensor_format=megarl",
                             "weights.pause_mode=abort", "weights.verify_interval=0"], validate=False)
    assert ManagerSpec.from_config(cfg).wire == WirePlan.of_config(cfg)  # nothing saved: decided alike
    run.mkdir()
    saved = WirePlan(tensor_format="sglang", adapters="peft", pause_mode="retract")
    saved.save(str(run))
    m = ManagerSpec.from_config(cfg)
    assert m.wire == saved and m.controller.lora_adapters  # requests name the PEFT adapter
