"""launch/slurm.sbatch for real on a two-node SLURM cluster: the rollout server on n1, the trainer on
n2, the demo config to the end; then SLURM's preemption warning (SIGUSR1) and `scontrol requeue`
(SIGTERM) in the middle of one run: each writes a checkpoint, the job comes back and resumes, and
metrics.jsonl ends with every step exactly once, in order."""
import os
import re
import stat
import subprocess
import urllib.error
import urllib.request

import psutil

from launchkit import REPO, clean_env, demo_overrides, metric_rows, wait_rows

SBATCH = os.path.join(REPO, "launch", "slurm.sbatch")
TINY_BYTES = os.path.getsize(os.path.join(REPO, "examples", "tiny", "model", "model.safetensors"))


def submit(slurm, tmp_path, *overrides, steps):
    run = tmp_path / "run"
    env = dict(slurm.env, ROLLOUT_NODES="1")
    jid = slurm.sbatch("--nodes=2", "--ntasks-per-node=1", SBATCH, *demo_overrides(run, steps, *overrides),
                       cwd=tmp_path, env=env)
    return jid, run


def job_log(tmp_path, jid) -> list[str]:
    return (tmp_path / f"megarl-{jid}.out").read_text().splitlines()


def no_process_mentions(path) -> list[str]:
    """Processes still alive whose command line names ``path`` (servers, trainers, supervisors)."""
    left = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if str(path) in cmd and p.pid != os.getpid():
            left.append(cmd)
    return left


def keyless_answers(url: str, key: str) -> dict:
    """HTTP status of a few routes of the job's server asked by another process of the node
    without the key, and of /model_info with it."""
    def status(path, headers=None, data=None):
        try:
            with urllib.request.urlopen(urllib.request.Request(url + path, data=data, headers=headers or {}),
                                        timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
    out = {path: status(path) for path in ("/health", "/model_info")}
    out.update({path: status(path, data=b"{}") for path in ("/pause_generation", "/weights_checksum")})
    out["/model_info with the key"] = status("/model_info", {"Authorization": f"Bearer {key}"})
    return out


def test_sbatch_runs_the_demo_across_a_rollout_node_and_a_trainer_node(slurm, tmp_path):
    jid, run = submit(slurm, tmp_path, steps=3)
    slurm.wait_done(jid)
    port = 20000 + jid % 20000
    log = job_log(tmp_path, jid)
    tag = f"[megarl job {jid} restart 0]"
    assert log[0] == f"{tag} start: rollout nodes [n1], trainer nodes [n2], run dir {run}", log
    assert f"{tag} rollout servers: http://127.0.0.2:30000 (listed in {run}/rollout_servers.txt)" in log
    assert log[-1] == f"{tag} trainer exited with 0", log
    assert "JobState=COMPLETED" in slurm.show(jid) and "ExitCode=0:0" in slurm.show(jid)
    assert (run / "rollout_servers.txt").read_text() == "http://127.0.0.2:30000\n"  # n1's NodeAddr

    # the trainer command the job ran is the one `megarl-launch --dry-run` prints for this allocation
    ran = next(line for line in log if line.startswith(f"{tag} trainer: ")).split("trainer: ", 1)[1]
    dry = subprocess.run(
        [os.environ.get("PYTHON", "python"), "-m", "megarl.launch.plan", "--dry-run",
         *demo_overrides(run, 3), "--trainer-nodes", "n2", "--rollout-nodes", "n1", "--tasks-per-node", "1",
         "--node-addr", "n1=127.0.0.2", "--node-addr", "n2=127.0.0.3", "--master-port", str(port),
         "--log-dir", f"{run}/logs", "--python", slurm.env["PYTHON"]],
        capture_output=True, text=True, env=clean_env(), cwd=str(tmp_path), check=True).stdout.splitlines()
    assert f"trainer: {ran}" in dry
    assert ran.startswith("srun --nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist=n2 --label ")
    assert f"--export=ALL,MASTER_ADDR=127.0.0.3,MASTER_PORT={port} " in ran

    trainer = (run / "logs" / "trainer.log").read_text().splitlines()
    assert f"0: [megarl] 1 rank(s) from slurm, rendezvous 127.0.0.3:{port}" in trainer
    assert all(re.match(r"0: ", line) for line in trainer if line.strip())  # srun --label
    rollout = (run / "logs" / "rollout-n1.log").read_text()
    assert "megarl-server ready on http://127.0.0.2:30000" in rollout
    # the planned server is keyed by a file in the run dir (never argv), the trainer reads the same file
    key_file = run / "servers" / "api_key"
    assert (run / "logs" / "servers.tsv").read_text().rstrip().endswith(f"--api-key-file {key_file}")
    assert ran.endswith(f" rollout.api_key_file={key_file}")
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and len(key_file.read_text()) >= 32
    rows = metric_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # distributed push, n2 -> n1 (weights.overlap: a step reports the push that landed in it)
    landed = [r for r in rows if "push/version" in r]
    assert len(landed) >= 2 and all(r["push/bytes"] > 0.99 * TINY_BYTES - 4096 for r in landed)
    assert no_process_mentions(run) == []  # the supervisor stopped the server; nothing is left behind


def test_preemption_warning_and_requeue_resume_the_same_run(slurm, tmp_path):
    steps = 24
    jid, run = submit(slurm, tmp_path, "checkpoint.save_interval=0", "checkpoint.keep_last=10", steps=steps)

    # 1. SLURM's time-limit warning: SIGUSR1 to every step. The trainer saves and stops, the
    #    rollout supervisor ignores it, and the batch script requeues the job itself.
    wait_rows(run, 2, diagnose=lambda: slurm.diagnose(jid))
    assert keyless_answers("http://127.0.0.2:30000", (run / "servers" / "api_key").read_text()) == {
        "/health": 200, "/model_info": 401, "/pause_generation": 401, "/weights_checksum": 401,
        "/model_info with the key": 200}
    slurm.run("scancel", "--signal=USR1", str(jid))
    slurm.wait_state(jid, ("PD",))
    k1 = metric_rows(run)[-1]["step"]
    assert 2 <= k1 < steps
    ckpts = sorted(os.listdir(run / "checkpoints"))
    assert ckpts == ["latest", f"step_{k1:08d}"]
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{k1:08d}"
    slurm.start_soon(jid)

    # 2. scontrol requeue: SIGTERM to everything; the trainer saves within KillWait
    wait_rows(run, k1 + 2, nudge=lambda: slurm.start_now(jid), diagnose=lambda: slurm.diagnose(jid))
    slurm.run("scontrol", "requeue", str(jid))
    slurm.wait_state(jid, ("PD",))
    k2 = metric_rows(run)[-1]["step"]
    assert k1 + 2 <= k2 < steps
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{k2:08d}"
    slurm.start_soon(jid)

    # 3. the third start resumes from step k2 and finishes
    slurm.wait_done(jid)
    assert [r["step"] for r in metric_rows(run)] == list(range(1, steps + 1))
    shown = slurm.show(jid)
    assert "JobState=COMPLETED" in shown and "Restarts=2" in shown
    log = job_log(tmp_path, jid)
    assert f"[megarl job {jid} restart 0] trainer stopped on a signal " \
           '({"signal": "SIGUSR1"}) and saved a checkpoint: requeueing' in log
    assert f"[megarl job {jid} restart 1] SIGTERM: the trainer finishes its step and saves" in log
    assert [line for line in log if line.endswith("trainer exited with 0")] == [
        f"[megarl job {jid} restart {i}] trainer exited with 0" for i in range(3)]
    trainer = (run / "logs" / "trainer.log").read_text()
    for k, sig in ((k1, "SIGUSR1"), (k2, "SIGTERM")):
        assert f"0: [megarl] stopped by {sig}; checkpoint saved, rerun to resume" in trainer
        assert f"0: [checkpoint] saved {run}/checkpoints/step_{k:08d}" in trainer
        assert f"0: [checkpoint] resumed from {run}/checkpoints/step_{k:08d} (step {k})" in trainer
    assert not (run / "stopped_by_signal.json").exists()  # the finished run cleared the marker
    assert no_process_mentions(run) == []
