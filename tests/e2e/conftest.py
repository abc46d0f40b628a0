"""Fixtures for the rollout-server e2e tests: tiny random HF checkpoints and `megarl-server`
subprocesses on free loopback ports (killed at teardown). The helpers live in e2e_servers.py."""

from __future__ import annotations

import pytest

from e2e_servers import API_KEY, ServerProc, http, make_model_with_tokenizer


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """(dir, state_dict) of a tiny Llama with a tokenizer; never modified by tests."""
    path = str(tmp_path_factory.mktemp("tiny"))
    return path, make_model_with_tokenizer(path)


@pytest.fixture(scope="session")
def _cluster(tiny_model):
    procs = [ServerProc(tiny_model[0], "--max-running-requests", "64", api_key=API_KEY) for _ in range(2)]
    try:
        yield [p.wait_ready() for p in procs]
    finally:
        for p in procs:
            p.stop()


@pytest.fixture
def cluster(_cluster, tiny_model):
    """Two servers shared by the whole session (API key `API_KEY`), handed to each test with the
    original weights, weight_version "0" and generation running."""
    for s in _cluster:
        assert s.proc.poll() is None, "a shared server died"
        # a session a test left open is closed (a server refuses /end_weight_update without one)
        code, out = http("POST", s.url + "/end_weight_update", {}, key=API_KEY)
        assert code == 200 or "no weight-update session is open" in str(out), out
        for path, body in (("/continue_generation", {}),
                           ("/update_weights_from_disk", {"model_path": tiny_model[0], "weight_version": "0"})):
            code, out = http("POST", s.url + path, body, key=API_KEY)
            assert code == 200, out
    return _cluster


@pytest.fixture(scope="module")
def start_server():
    """start_server(model_dir, *args, api_key=None, n=1) -> ServerProc (n == 1) or a list of n,
    started in parallel; all stopped at the end of the module."""
    procs: list[ServerProc] = []

    def start(model_dir: str, *args: str, api_key: str | None = None, n: int = 1):
        new = [ServerProc(model_dir, *args, api_key=api_key) for _ in range(n)]
        procs.extend(new)
        for p in new:
            p.wait_ready()
        return new[0] if n == 1 else new

    yield start
    for p in procs:
        p.stop()
