"""megarl/mcore/ leans on private and deep megatron-core names of one release (the table in
megarl/mcore/pins.py). These checks fail first, and by name, when the installed megatron-core is not
that release, or when a name in the table is gone or its call signature changed, instead of a dist
test failing deep inside Megatron (or, worse, a resume silently training from a wrong optimizer
state). No ranks needed: imports, getattr and inspect only."""
import warnings

import pytest

from megarl.mcore import pins


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed" on import
        yield


def test_installed_megatron_core_is_the_supported_release():
    import megatron.core

    installed = megatron.core.__version__
    assert installed == pins.SUPPORTED_MCORE_VERSION, (
        f"megarl/mcore/ is pinned to megatron-core {pins.SUPPORTED_MCORE_VERSION} but {installed} is "
        "installed: re-check every entry of megarl/mcore/pins.py and the list in docs/architecture.md "
        "('Upgrading megatron-core') before moving the pin")


def _pin_id(pin) -> str:
    return pin.path if pin.text is None else f"{pin.path} contains {pin.text}"


@pytest.mark.parametrize("pin", pins.PINS, ids=_pin_id)
def test_every_pinned_name_resolves_with_its_recorded_signature(pin):
    assert pins.pin_problem(pin) is None, pins.pin_problem(pin)


def test_the_behaviour_checks_pass():
    assert pins.pin_problems() == []


def test_the_table_covers_every_kind_and_records_each_call_signature():
    assert {p.kind for p in pins.PINS} == {"call", "attr", "self", "source"}
    assert all(p.signature for p in pins.PINS if p.kind == "call")
    assert len({p.key for p in pins.PINS}) == len(pins.PINS)  # no entry twice


def test_the_pin_check_names_a_missing_or_changed_entry():
    gone = pins.Pin("megatron.core.dist_checkpointing.strategies.torch:_no_such_private_helper", "attr",
                    "checkpoint.py", "test")
    unset = pins.Pin("megatron.core.optimizer.optimizer:ChainedOptimizer.no_such_attribute", "self",
                     "optimizer.py", "test")
    changed = pins.Pin("megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32", "call",
                       "optimizer.py", "test", "(parameters, max_norm)")
    unmentioned = pins.Pin("megatron.core.transformer.moe.moe_utils:no_such_global", "source", "cpu.py", "t")
    unsaid = pins.Pin("megatron.core.transformer.moe.router:TopKRouter.apply_z_loss", "source", "moe.py", "t",
                      text="if self.config.moe_z_loss_coeff > 0")
    problems = pins.pin_problems((gone, unset, changed, unmentioned, unsaid))
    assert len(problems) == 5, problems
    assert problems[0].startswith(f"{gone.path}: gone (AttributeError"), problems[0]
    assert problems[1] == f"{unset.path}: gone (no longer sets self.no_such_attribute)"
    assert problems[2] == (f"{changed.path}: signature changed: recorded (parameters, max_norm), installed "
                           "(parameters, max_norm, total_norm, use_decoupled_grad=False)")
    assert problems[3] == f"{unmentioned.path}: gone (no longer mentioned)"
    assert problems[4] == f"{unsaid.path}: no longer contains 'if self.config.moe_z_loss_coeff > 0'"


def test_call_signature_renders_names_kinds_and_defaults():
    def f(a, b: int = 1, *args, c=None, **kw):
        pass

    def g(a, *, d="x"):
        pass

    assert pins.call_signature(f) == "(a, b=1, *args, c=None, **kw)"
    assert pins.call_signature(g) == "(a, *, d='x')"
