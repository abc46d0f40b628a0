"""megarl/models/routing_replay.py hooks megatron-core's TopKRouter and its top-k function: these
checks fail first, and by name, when the installed megatron-core is not the pinned release or
when one of the internals the replay uses changed (instead of a replay that silently stops
forcing the routes). No ranks needed: imports, getattr and source text only."""
import warnings

from megarl.models import routing_replay


def test_installed_megatron_core_is_the_supported_release():
    import megatron.core

    assert megatron.core.__version__ == routing_replay.SUPPORTED_MCORE_VERSION, (
        f"megarl/models/routing_replay.py is pinned to megatron-core {routing_replay.SUPPORTED_MCORE_VERSION}: "
        f"re-verify the internals in its docstring and run tests/dist/test_routing_replay.py")


def test_every_internal_used_still_exists():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        problems = routing_replay.pin_problems()
    assert not problems, "routing replay relies on megatron-core internals that changed:\n  " + "\n  ".join(problems)


def test_the_pin_check_notices_a_change(monkeypatch):
    monkeypatch.setattr(routing_replay, "PRIVATE_NAMES", routing_replay.PRIVATE_NAMES + (
        ("megatron.core.transformer.moe.router", "TopKRouter.no_such_method"),))
    monkeypatch.setattr(routing_replay, "SOURCE_TEXT", routing_replay.SOURCE_TEXT + (
        ("megatron.core.transformer.moe.router", "TopKRouter", "self.no_such_attribute ="),))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        problems = routing_replay.pin_problems()
    assert any("TopKRouter.no_such_method: gone" in p for p in problems), problems
    assert any("no longer contains 'self.no_such_attribute ='" in p for p in problems), problems
