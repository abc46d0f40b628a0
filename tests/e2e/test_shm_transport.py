"""`weights.transport: shm`: the trainer writes each bucket once into a file in /dev/shm and the
megarl-server on the same host maps it - no weight byte crosses a socket. A real megarl-train run
against a real megarl-server, whose own counters (/get_server_info) say where the bytes came
through; the run's logprob gap at step 1 passes the mismatch gate (the handed-over weights are
the trainer's), and the file is gone when the run ends."""
import glob
import os
import subprocess
import sys

import harness
from e2e_servers import ServerProc, http

from megarl.protocol.wire import SHM_DIR, SHM_PREFIX

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def handover_files() -> set[str]:
    return set(glob.glob(os.path.join(SHM_DIR, SHM_PREFIX + "*")))


def test_the_push_crosses_no_socket(tmp_path):
    before = handover_files()  # another test's SIGKILLed trainer may have left one
    server = ServerProc(f"{REPO}/examples/tiny/model").wait_ready()
    try:
        run = harness.train(tmp_path / "run", "train.global_batch_size=64", "rollout.eval_at_start=false",
                            "train.steps=3", f"rollout.servers=[{server.url}]", "weights.transport=shm",
                            "rollout.max_staleness=0", check=True)
        info = http("GET", server.url + "/get_server_info")[1]
    finally:
        server.stop()
    rows = run.rows
    params = 2_300_000 // 4  # the tiny model's ~0.58 M fp32 parameters, at least once per push
    assert info.get("weight_bytes_socket", 0) == 0  # nothing ever came through a socket
    assert info["weight_bytes_shared_memory"] >= 3 * params * 4 * 0.9
    assert info["weight_version"] == "3"
    assert rows[0]["mismatch/mean"] <= 1e-4 and rows[0]["mismatch/onpolicy_frac"] == 1.0, rows[0]
    assert not handover_files() - before  # this run's file was removed at its end


def test_the_file_of_a_killed_trainer_is_removed_by_the_next_run(tmp_path):
    from megarl.weights.transports import remove_orphans

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid no process has now
    orphan = os.path.join(SHM_DIR, f"{SHM_PREFIX}{dead.pid}-pp0")
    alive = os.path.join(SHM_DIR, f"{SHM_PREFIX}{os.getpid()}-pp7")
    for path in (orphan, alive):
        with open(path, "wb") as f:
            f.write(b"x")
    try:
        assert orphan in remove_orphans(SHM_DIR, SHM_PREFIX)
        assert not os.path.exists(orphan) and os.path.exists(alive)
    finally:
        for path in (orphan, alive):
            if os.path.exists(path):
                os.unlink(path)


def test_shm_against_a_remote_address_is_refused_at_preflight(tmp_path):
    run = harness.train(tmp_path / "run", "rollout.servers=[http://10.255.255.1:30000]", "weights.transport=shm",
                        "weights.tensor_format=megarl", "weights.verify_interval=0", "weights.pause_mode=abort",
                        "rollout.health_timeout_s=2", timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().count("\n") == 0, run.stderr
    assert not (tmp_path / "run").exists()
