"""Shared pytest setup: tier directories on sys.path so their helper modules import."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for tier in ("dist", "e2e"):
    path = os.path.join(HERE, tier)
    if path not in sys.path:
        sys.path.insert(0, path)

import pytest  # noqa: E402

_LAUNCHER_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


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
