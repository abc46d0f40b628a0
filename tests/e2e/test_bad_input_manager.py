"""Bad-input corpus, class "a manager started apart that is not one": rollout.manager_address
pointed at an HTTP server, at a closed port, at `nonsense`, or at a real megarl-rollout-manager
with another secret file. Preflight checks the address (listening, speaking the channel's
handshake, accepting rollout.manager_secret_file) before any rank starts: each case is one line
naming the field, exit status 2, no run directory, within a few seconds (it used to hang up to
600 s, retry silently for 60 s, or fail after the ranks started). The cases run in-process
(badinput_support.run_in_process): the wall time each takes is then the refusal's own, not a
new interpreter's imports (as subprocesses they took 15-33 s on a loaded 2-core machine, past
the 20 s bound, with the handshake's 3 s inside); a wait that regresses into a hang ends at the
runner's watchdog (inprocess_cli), the same 300 s bound as the subprocess timeout."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from badinput_support import REPO, TINY, CliCase, closed_port, corpus_tests, fake_server

GRPO = ("{grpo_yaml}", "model.hf_path={model}", "data.train_path={rl}", "data.eval_path=",
        "train.run_dir={root}/runs/{id}", "rollout.manager_secret_file={secret}")


def A(id, address, *needles, extra=()):  # noqa: N802 - a table row
    return CliCase(id, "megarl-train", GRPO + (f"rollout.manager_address={address}", *extra), 2, needles,
                   ("{root}/runs/{id}",))


CASES = {f"megarl-train:{c.id}": c for c in [
    A("manager_address_http_server", "{http}", "rollout.manager_address: {http}: no channel handshake within",
      "not a megarl rollout manager"),
    A("manager_address_closed_port", "{closed}", "rollout.manager_address: {closed}: cannot connect",
      "Connection refused"),
    A("manager_address_nonsense", "nonsense", "rollout.manager_address: expected host:port, got 'nonsense'"),
    A("manager_secret_file_wrong", "{manager}", "rollout.manager_secret_file: '{other_secret}' is not the secret "
      "of the manager at rollout.manager_address={manager}", "refused this run's secret",
      extra=("rollout.manager_secret_file={other_secret}",)),
]}


def _secret(path: str, text: str) -> str:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("badmanager"))
    secret = _secret(f"{root}/secret", "a" * 32)
    # the wire set explicitly: a manager run apart resolves auto against its servers (nothing
    # answers at :9; no server is needed to refuse these clients)
    yaml = open(f"{REPO}/configs/tiny_grpo.yaml").read().replace(
        "rollout:\n", f"rollout:\n  manager_secret_file: {secret}\n  servers: [http://127.0.0.1:9]\n", 1).replace(
        "weights:\n", "weights:\n  tensor_format: megarl\n  verify_interval: 1\n  pause_mode: abort\n", 1)
    with open(f"{root}/mgr.yaml", "w") as f:
        f.write(yaml)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # a real manager started apart, with its own secret (servers given: none starts)
    proc = subprocess.Popen([sys.executable, "-m", "megarl.rollout.manager", f"{root}/mgr.yaml"],
                            stdout=subprocess.PIPE, stderr=open(f"{root}/mgr.log", "w"), text=True, env=env)
    line = proc.stdout.readline().strip()
    assert line.startswith("listening "), open(f"{root}/mgr.log").read()[-2000:]
    http_url, srv = fake_server({"/": (200, b"{}")})
    os.makedirs(f"{root}/runs")
    paths = {"root": root, "grpo_yaml": f"{REPO}/configs/tiny_grpo.yaml", "model": f"{TINY}/model",
             "rl": f"{TINY}/data/rl_prompts.jsonl", "secret": secret,
             "other_secret": _secret(f"{root}/other_secret", "b" * 32), "manager": line.split(" ", 1)[1],
             "http": http_url.removeprefix("http://"), "closed": f"127.0.0.1:{closed_port()}"}
    yield root, lambda text: text.format(**paths)
    srv.shutdown()
    proc.kill()
    proc.wait(timeout=10)


results, test_manager_case, test_docs_list_every_case = corpus_tests(CASES)


def test_each_case_ends_within_seconds(results):
    """Not the old 600 s hang or 60 s of silent retries: the handshake's 5 s at most."""
    walls = {k: round(r.wall_s, 1) for k, r in results.items()}
    print(walls)
    assert all(w < 20 for w in walls.values()), walls
