"""Shared pytest setup: the tiers, the tier directories on sys.path, the launcher-env guard.

Tiers (tests/README.md): every test carries exactly one of the markers below, given here from
its directory unless the test itself says `slow`:

  fast    tests/unit: in-process, no megarl-train, no server subprocess (<= 3 min)
  slow    tests/dist, tests/e2e, tests/launch and any unit test marked slow
  sglang  real SGLang (its own venv); also slow
  gpu     tests/gpu (skips without CUDA)

`python -m pytest tests` runs them all, the fast tier first; a failure there stops the run
before the first slower test (the rest would only add minutes to a known-red run)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for tier in ("", "dist", "e2e"):  # tests/ itself: harness.py
    path = os.path.join(HERE, tier) if tier else HERE
    if path not in sys.path:
        sys.path.insert(0, path)

import pytest  # noqa: E402

_LAUNCHER_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
_DIR_TIER = {"unit": "fast", "dist": "slow", "e2e": "slow", "launch": "slow", "gpu": "gpu"}
_fast_failures: list[str] = []


def _tier(item) -> str:
    rel = os.path.relpath(str(item.path), HERE).split(os.sep)[0]
    tier = _DIR_TIER.get(rel, "slow")
    if item.get_closest_marker("sglang") or (tier == "fast" and item.get_closest_marker("slow")):
        return "slow"  # an sglang test is slow too, wherever it lives
    return tier


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks each item with its tier (before `-m` selects) and runs the fast tier first."""
    for item in items:
        item.add_marker(_tier(item))
    items.sort(key=lambda item: item.get_closest_marker("fast") is None)  # stable


def pytest_runtest_logreport(report):
    if report.failed and "fast" in report.keywords:
        _fast_failures.append(report.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    if _fast_failures and nextitem is not None and nextitem.get_closest_marker("fast") is None:
        item.session.shouldstop = (f"the fast tier failed ({len(_fast_failures)} test(s), first "
                                   f"{_fast_failures[0]}): the slow tiers were not run")


@pytest.fixture(scope="session")
def shared_train(tmp_path_factory):
    """shared_train(*overrides, recipe=..., ...) -> harness.Run: one megarl-train run per set of
    arguments in this pytest session, made on first use and only read by the tests after it."""
    import harness

    return harness.SharedRuns(tmp_path_factory.mktemp("shared_runs"))


@pytest.fixture(autouse=True)
def _no_leaked_launcher_env():
    """Tools run in-process set MASTER_PORT for their own one-rank group; a later test's child
    process must not inherit it (it would bind a port this process still holds)."""
    saved = {k: os.environ.get(k) for k in _LAUNCHER_VARS}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
