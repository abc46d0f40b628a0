"""megarl/checkpoint/mcore.py leans on private megatron-core internals of one release. These checks
fail first, and by name, when the installed megatron-core is not that release or when one of the
internals it uses is gone, instead of a checkpoint test failing deep inside DCP (or, worse, a
resume silently training from a wrong optimizer state). No ranks needed: imports and getattr only."""
import warnings

from megarl.checkpoint import mcore


def test_installed_megatron_core_is_the_supported_release():
    import megatron.core

    installed = megatron.core.__version__
    assert installed == mcore.SUPPORTED_MCORE_VERSION, (
        f"megarl/checkpoint/mcore.py is pinned to megatron-core {mcore.SUPPORTED_MCORE_VERSION} but "
        f"{installed} is installed: re-verify every private internal listed in its docstring and "
        f"run tests/dist/test_checkpoint*.py before moving the pin")


def test_every_private_internal_used_still_exists():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed" on import
        problems = mcore.pin_problems()
    assert not problems, (
        "megarl/checkpoint/mcore.py relies on megatron-core internals that changed:\n  "
        + "\n  ".join(problems))


def test_the_pin_check_notices_a_missing_name(monkeypatch):
    monkeypatch.setattr(mcore, "PRIVATE_NAMES", mcore.PRIVATE_NAMES + (
        ("megatron.core.dist_checkpointing.strategies.torch", "_no_such_private_helper"),))
    monkeypatch.setattr(mcore, "INSTANCE_ATTRS", mcore.INSTANCE_ATTRS + (
        ("megatron.core.optimizer.optimizer", "ChainedOptimizer", "no_such_attribute"),))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        problems = mcore.pin_problems()
    assert any("_no_such_private_helper: gone" in p for p in problems), problems
    assert any("no longer sets self.no_such_attribute" in p for p in problems), problems
