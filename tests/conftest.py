"""Shared pytest setup: the tiers, the tier directories on sys.path, the launcher-env guard.

Tiers (tests/README.md): every test carries exactly one of the markers below, given here from
its directory unless the test itself says `slow`:

  fast    tests/unit: in-process, no megarl-train, no server subprocess (<= 3 min)
  slow    tests/dist, tests/e2e, tests/launch and any unit test marked slow
  sglang  real SGLang (its own venv); also slow
  gpu     tests/gpu (skips without CUDA)

`python -m pytest tests` runs them all, the fast tier first; a failure there stops the run
before the first slower test (the rest would only add minutes to a known-red run).

Two at a time (pytest.ini: `-n 2 --dist loadgroup`, pytest-xdist): a test runs on one of two
worker processes, a whole group at a time, and a group is its module (module fixtures and the
torchrun results the dist tier caches per module are made once) unless it says otherwise:
`xdist_group("sglang")` for the SGLang tier (one real engine at a time; the first use installs its
venv), `"launch"` for tests/launch (one SLURM cluster), and a named group for modules that read
one `shared_train` run. The SGLang group is handed out first among the slow tests: it is the
longest, and a worker that starts it last would leave the other idle at the end."""
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
        tier = _tier(item)
        item.add_marker(tier)
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_group(item, tier)))
    items.sort(key=_order)  # stable


_FIRST_GROUPS = ("sglang", "launch")  # the longest serial groups, handed out first among the slow


def _group(item, tier: str) -> str:
    if item.get_closest_marker("sglang"):
        return "sglang"
    rel = os.path.relpath(str(item.path), HERE)
    return "launch" if rel.split(os.sep)[0] == "launch" else rel


def _order(item) -> tuple:
    if item.get_closest_marker("fast") is not None:
        return (0, 0)
    group = item.get_closest_marker("xdist_group").args[0]
    return (1, _FIRST_GROUPS.index(group) if group in _FIRST_GROUPS else len(_FIRST_GROUPS))


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
