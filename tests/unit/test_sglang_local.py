"""rollout.engine=sglang without starting SGLang: the flag mapping, one-line errors for what
SGLang cannot do, the CPU vs GPU command, and the process-group kill of a forked server."""
import os
import subprocess
import sys
import time

import pytest

from megarl.config import load_config
from megarl.common.errors import ConfigError
from megarl.rollout import sglang_local as S
from megarl.rollout.local import LocalServers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(REPO, "configs", "tiny_grpo.yaml")
_unpatched_sglang_python = S.sglang_python


def test_megarl_server_flags_map_to_sglang_or_are_refused():
    assert S.sglang_flags(["--seed", 3, "--tp=2", "--max-running-requests", "8",
                           "--enable-return-routed-experts"]) == [
        "--random-seed", "3", "--tp-size=2", "--max-running-requests", "8", "--enable-return-routed-experts"]
    for flag in ("--threads", "--weights-root", "--weight-version", "--tp-rank", "--tp-port"):
        with pytest.raises(ConfigError, match=f"^rollout.server_args: {flag} is a megarl-server flag"):
            S.sglang_flags([flag, "1"])
    with pytest.raises(ConfigError, match="^rollout.server_args: --port is set by the job"):
        S.sglang_flags(["--port=1"])


def test_engine_is_validated_with_its_field_name():
    assert load_config(RECIPE).rollout.engine == "megarl"
    assert load_config(RECIPE, ["rollout.engine=sglang"]).rollout.engine == "sglang"
    with pytest.raises(ConfigError, match="rollout.engine"):
        load_config(RECIPE, ["rollout.engine=vllm"])
    with pytest.raises(ConfigError, match="rollout.server_args: --threads"):
        load_config(RECIPE, ["rollout.engine=sglang", "rollout.server_args=[--threads,2]"])
    # external servers: the local flags are not used, nothing to refuse
    load_config(RECIPE, ["rollout.engine=sglang", "rollout.server_args=[--threads,2]",
                         "rollout.servers=[http://127.0.0.1:1]"])


def test_missing_sglang_is_one_line_naming_the_engine(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGARL_SGLANG_VENV", str(tmp_path / "none"))
    monkeypatch.setattr(S.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError) as e:
        S.sglang_python()
    assert str(e.value).startswith("rollout.engine: sglang, but SGLang is not installed") and "\n" not in str(e.value)


def test_model_dir_needs_an_hf_tokenizer(tmp_path):
    with pytest.raises(ConfigError, match="^model.hf_path: rollout.engine=sglang needs an HF tokenizer"):
        S.check_model_dir(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{}")
    S.check_model_dir(str(tmp_path))


def test_cpu_command_carries_the_cpu_settings_and_gpu_the_plain_one(tmp_path):
    cpu = S.server_args("/m", 5, extra=["--log-level-http", "info"])
    assert cpu[:8] == ["-m", "sglang.launch_server", "--model-path", "/m", "--host", "127.0.0.1", "--port", "5"]
    for flag, value in (("--device", "cpu"), ("--attention-backend", "torch_native"), ("--dtype", "float32"),
                        ("--max-total-tokens", "16384")):
        assert cpu[cpu.index(flag) + 1] == value
    assert cpu[-2:] == ["--log-level-http", "info"]  # the user's flags last: they win
    # GPU: the plain command, then the feature flags (tests/unit/test_feature_flags.py)
    assert S.server_args("/m", 5, cpu=False) == cpu[:8]
    assert S.server_args("/m", 5, cpu=False, extra=["--enable-memory-saver"]) == cpu[:8] + ["--enable-memory-saver"]
    env = S.server_env(base={"PYTHONPATH": "/x"}, threads=2)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["OMP_NUM_THREADS"] == "2"
    assert env["PYTHONPATH"] == S.STANDIN_KERNEL + os.pathsep + "/x"


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_the_manager_starts_sglang_with_the_memory_saver_when_colocated(monkeypatch, tmp_path, placement):
    """rollout.placement reaches the SGLang command the manager's local servers run (on GPU). No
    server starts: `LocalServers` is replaced by a stand-in that only keeps the launcher."""
    from megarl.rollout import local
    from megarl.rollout.manager import ManagerSpec, RolloutManager
    from megarl.rollout.probe import check_wire

    (tmp_path / "tokenizer.json").write_text("{}")  # what SGLangLauncher checks for
    cfg = load_config(RECIPE, ["rollout.engine=sglang", f"rollout.placement={placement}", "rollout.max_staleness=0",
                               f"model.hf_path={tmp_path}", f"train.run_dir={tmp_path}/run"])
    launchers = []

    class GPULauncher(S.SGLangLauncher):  # as on a CUDA machine, whichever Python has SGLang here
        def __init__(self, *args, **kwargs):
            super().__init__(*args, cpu=False, python=sys.executable, **kwargs)

    class NoServers:
        def __init__(self, *args, launcher=None, **kwargs):
            launchers.append(launcher)

        def __enter__(self):
            return []

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(S, "SGLangLauncher", GPULauncher)
    monkeypatch.setattr(S, "cuda_available", lambda: True)  # the trainer sees the node's GPUs
    monkeypatch.setattr(local, "LocalServers", NoServers)
    check_wire(cfg)  # as the manager does with a config not yet resolved
    manager = RolloutManager(ManagerSpec.from_config(cfg))
    try:
        manager.start_servers()
    finally:
        manager.close()
    argv = launchers[0].argv(30000, "127.0.0.1")
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert ("--enable-memory-saver" in argv) == (placement == "colocated"), argv


class ForkingLauncher(S.SGLangLauncher):
    """SGLangLauncher's spawn/kill around a stand-in command that, like SGLang, forks a child
    and serves /health (an http.server) - the process-group handling under test, not SGLang."""

    def __init__(self):
        self.name = "forking"

    def spawn(self, port, log_path, host, cpus=None):
        code = ("import http.server, subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                "'import time; time.sleep(600)']); http.server.HTTPServer(('127.0.0.1', %d), "
                "type('H', (http.server.BaseHTTPRequestHandler,), {'do_GET': lambda s: (s.send_response(200), "
                "s.end_headers())})).serve_forever()" % port)
        return subprocess.Popen([sys.executable, "-c", code], stdout=open(log_path, "a"),
                                stderr=subprocess.STDOUT, start_new_session=True)


def _group_alive(pgid: int, wait_s: float = 5.0) -> bool:
    """Whether a process of group ``pgid`` runs (zombies awaiting their reaper do not count)."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = False
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            alive |= int(fields[2]) == pgid and fields[0] != "Z"
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def test_cluster_kills_the_whole_group_on_restart_and_close(tmp_path):
    cluster = LocalServers("/unused", 1, str(tmp_path), launcher=ForkingLauncher(), ready_timeout_s=30)
    with cluster as urls:
        first = cluster.procs[0].pid
        time.sleep(0.5)  # the child is forked
        os.kill(first, 9)  # the leader dies; its child lives on in the group
        assert _group_alive(first, wait_s=0)
        assert cluster.restart(urls[0])
        assert not _group_alive(first)
        second = cluster.procs[0].pid
    assert not _group_alive(second)


def test_preflight_stops_a_sglang_run_before_any_rank(monkeypatch, tmp_path):
    from megarl.launch.preflight import check_inputs

    demo = os.path.join(REPO, "examples", "tiny")
    cfg = load_config(RECIPE, ["rollout.engine=sglang", f"model.hf_path={demo}/model", "data.eval_path=",
                               f"data.train_path={demo}/data/rl_prompts.jsonl", f"train.run_dir={tmp_path}/run"])
    monkeypatch.setattr(S, "sglang_python", lambda: sys.executable)  # installed or not, here
    with pytest.raises(ConfigError, match="^model.hf_path: rollout.engine=sglang needs an HF tokenizer"):
        check_inputs(cfg)
    monkeypatch.setenv("MEGARL_SGLANG_VENV", str(tmp_path / "none"))
    monkeypatch.setattr(S, "sglang_python", _unpatched_sglang_python)
    monkeypatch.setattr(S.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="^rollout.engine: sglang, but SGLang is not installed"):
        check_inputs(cfg)
    assert not os.path.exists(tmp_path / "run")
