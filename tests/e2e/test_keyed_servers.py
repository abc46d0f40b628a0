"""Nothing else on the node can steer a run's own servers (issue 40): during a real demo run
(real trainer, rollout manager and the megarl-server it starts), a local client without the
run's key gets 401 on every route the server has but /health - the weight updates, the pause,
the checksums and generation alike - and the run's key, kept in <run>/servers/api_key (0600 in
a 0700 directory, never on a command line), opens them. The run's directory and config.yaml are
its user's alone."""
from __future__ import annotations

import json
import os
import stat
import time
import urllib.error
import urllib.request

import harness
from test_security import route_table  # every route megarl-server registers


def call(method: str, url: str, key: str | None = None) -> int:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = b"{}" if method == "POST" else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_keyless_local_client_is_refused_on_every_route_during_a_run(tmp_path):
    seen: dict = {}
    run_dir = tmp_path / "run"

    def probe(proc):
        index = run_dir / "servers" / "servers.json"
        deadline = time.monotonic() + 600  # a loaded machine starts them slowly
        while not index.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert index.exists(), "the run's servers never started"
        url = json.loads(index.read_text())[0]["url"]
        seen["pid_cmdline"] = open(f"/proc/{json.loads(index.read_text())[0]['pid']}/cmdline", "rb").read()
        seen["keyless"] = {(m, p): call(m, url + p) for m, p in sorted(route_table())}
        key = (run_dir / "servers" / "api_key").read_text()
        seen["keyed"] = call("GET", url + "/model_info", key)
        seen["key"] = key

    run = harness.train(run_dir, "train.steps=3", "train.global_batch_size=64", "rollout.eval_at_start=false",
                        "checkpoint.save_interval=0", during=probe)
    run.check()
    answered = {route: code for route, code in seen["keyless"].items() if code != 401}
    assert answered == {("GET", "/health"): 200, ("HEAD", "/health"): 200}, answered  # liveness only
    assert len(seen["keyless"]) >= 20  # every route: weights, pause, checksum, generate, LoRA, memory ...
    assert seen["keyed"] == 200
    assert len(seen["key"]) >= 32 and seen["key"].encode() not in seen["pid_cmdline"]  # not on argv
    assert seen["key"] not in (run_dir / "config.yaml").read_text()  # the manager made it; config has none
    for path, mode in ((run_dir, 0o700), (run_dir / "config.yaml", 0o600), (run_dir / "servers", 0o700),
                       (run_dir / "servers" / "api_key", 0o600)):
        assert stat.S_IMODE(os.stat(path).st_mode) == mode, (path, oct(os.stat(path).st_mode))
    assert [r["step"] for r in run.rows] == [1, 2, 3]
