"""megarl.launch.spawn: the local ranks a command outside any launcher starts for itself (megarl-train
with tp*pp > 1, megarl-convert --tp 2), with rank 0 serving the rendezvous store on loopback.
Real processes, real gloo groups, listeners read from /proc/net/tcp{,6}."""
import json
import os
import signal
import subprocess
import sys
import time

from distrun import HERE

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
           PYTHONWARNINGS="ignore")
ENV.pop("OMP_NUM_THREADS", None)


def start(out, mode: str, grace_s: float = 30.0) -> subprocess.Popen:
    code = (f"import sys; from megarl.launch.spawn import run_ranks; "
            f"sys.exit(run_ranks(2, 'spawn_worker', [{str(out)!r}, {mode!r}], grace_s={grace_s}))")
    return subprocess.Popen([sys.executable, "-c", code], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def read(out, rank: int) -> dict:
    return json.loads((out / f"rank{rank}.json").read_text())


def test_two_ranks_meet_and_listen_on_loopback_only(tmp_path):
    proc = start(tmp_path, "ok")
    assert proc.wait(timeout=120) == 0, proc.stdout.read()[-3000:]
    ranks = [read(tmp_path, r) for r in (0, 1)]
    assert [r["sum"] for r in ranks] == [3.0, 3.0]  # 1 + 2: the all-reduce crossed both ranks
    assert [r["env"]["RANK"] for r in ranks] == ["0", "1"]
    assert all(r["env"]["OMP_NUM_THREADS"] == "1" and r["env"]["WORLD_SIZE"] == "2" for r in ranks)
    port = int(ranks[0]["env"]["MASTER_PORT"])
    # rank 0 serves the store at 127.0.0.1:MASTER_PORT (torch alone would bind [::]); gloo's own
    # pair listeners sit on the address the host name resolves to, loopback on this machine
    assert ["127.0.0.1", port] in ranks[0]["listening"], ranks[0]
    every = [tuple(a) for r in ranks for a in r["listening"]]
    assert every and all(host not in ("0.0.0.0", "::") for host, _ in every), every


def test_a_failing_rank_ends_the_job_with_its_code_and_stops_the_others(tmp_path):
    t0 = time.monotonic()
    proc = start(tmp_path, "fail", grace_s=5.0)
    rc = proc.wait(timeout=120)
    assert rc == 3, proc.stdout.read()[-3000:]
    assert time.monotonic() - t0 < 60  # rank 0, hung for 300 s, was stopped: it did not hold the job


def test_a_stop_signal_reaches_every_rank_once(tmp_path):
    proc = start(tmp_path, "signal")
    deadline = time.monotonic() + 90
    while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.stdout.read()[-3000:]
    assert [(tmp_path / f"term{r}").read_text() for r in (0, 1)] == ["x", "x"]
