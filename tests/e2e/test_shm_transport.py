"""`weights.transport: shm`: the trainer writes each bucket once into a file in /dev/shm and the
megarl-server on the same host maps it - no weight byte crosses a socket. A real megarl-train run
against a real megarl-server, whose own counters (/get_server_info) say where the bytes came
through; the run's logprob gap at step 1 passes the mismatch gate (the handed-over weights are
the trainer's), and the file is gone when the run ends."""
import glob
import json
import os
import subprocess
import sys

from e2e_servers import ServerProc, http

from megarl.protocol.wire import SHM_DIR, SHM_PREFIX

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def handover_files() -> set[str]:
    return set(glob.glob(os.path.join(SHM_DIR, SHM_PREFIX + "*")))


def test_the_push_crosses_no_socket(tmp_path):
    before = handover_files()  # another test's SIGKILLed trainer may have left one
    server = ServerProc(f"{REPO}/examples/tiny/model").wait_ready()
    try:
        run = tmp_path / "run"
        cmd = [sys.executable, "-m", "megarl.train", os.path.join(REPO, "configs", "tiny_grpo.yaml"),
               f"model.hf_path={REPO}/examples/tiny/model",
               f"data.train_path={REPO}/examples/tiny/data/rl_prompts.jsonl", "data.eval_path=",
               f"train.run_dir={run}", "checkpoint.hf_export_dir=", "train.global_batch_size=64",
               "rollout.eval_at_start=false", "train.steps=3", f"rollout.servers=[{server.url}]",
               "weights.transport=shm", "rollout.max_staleness=0"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stderr[-4000:]
        info = http("GET", server.url + "/get_server_info")[1]
    finally:
        server.stop()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
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
    cmd = [sys.executable, "-m", "megarl.train", os.path.join(REPO, "configs", "tiny_grpo.yaml"),
           f"model.hf_path={REPO}/examples/tiny/model", f"train.run_dir={tmp_path}/run",
           f"data.train_path={REPO}/examples/tiny/data/rl_prompts.jsonl", "data.eval_path=",
           "rollout.servers=[http://10.255.255.1:30000]", "weights.transport=shm",
           "weights.tensor_format=megarl", "weights.verify_interval=0", "weights.pause_mode=abort",
           "rollout.health_timeout_s=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert not (tmp_path / "run").exists()
