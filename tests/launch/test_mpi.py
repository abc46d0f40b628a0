"""launch/mpi.sh: the demo config under `mpirun -np 2` (Open MPI ranks, PP=2) and under
`srun --mpi=pmix` across the two fake nodes of the test cluster (PMIx ranks, PP=2: stage 1's
weight source on n2 pushes to the server rank 0 started on n1)."""
import os
import re
import shutil
import subprocess

import pytest

from launchkit import REPO, clean_env, demo_overrides, metric_rows

MPI_SH = os.path.join(REPO, "launch", "mpi.sh")


@pytest.mark.skipif(not shutil.which("mpirun"), reason="Open MPI's mpirun is not installed (apt openmpi-bin)")
def test_mpirun_np2_runs_the_demo(tmp_path):
    run = tmp_path / "run"
    env = clean_env(NP="2", MPIRUN_ARGS="--oversubscribe")
    proc = subprocess.run(["bash", MPI_SH, *demo_overrides(run, 2, "parallel.pp=2")], env=env, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "[mpi.sh] mpirun: 2 ranks, rendezvous 127.0.0.1:" in out
    assert "[megarl] 2 rank(s) from ompi, rendezvous 127.0.0.1:" in out
    assert re.search(r"\[weights\] stage 1: weight-update group megarl-weights-pp1-[0-9a-f]{8} at 127\.0\.0\.1:", out)
    assert [r["step"] for r in metric_rows(run)] == [1, 2]


def test_srun_pmix_runs_the_demo_across_two_nodes(slurm, tmp_path):
    run = tmp_path / "run"
    cmd = " ".join([f"MPI_LAUNCHER=srun NP=2 bash {MPI_SH}", *demo_overrides(run, 2, "parallel.pp=2")])
    jid = slurm.sbatch("--nodes=2", "--ntasks-per-node=1", "--output=pmix-%j.out", f"--wrap={cmd}", cwd=tmp_path)
    slurm.wait_done(jid)
    out = (tmp_path / f"pmix-{jid}.out").read_text()
    port = 20000 + jid % 20000
    assert "JobState=COMPLETED" in slurm.show(jid), out[-4000:]
    assert f"[mpi.sh] srun: 2 ranks, rendezvous 127.0.0.2:{port}" in out  # n1's NodeAddr, port from the job id
    assert f"0: [megarl] 2 rank(s) from pmix, rendezvous 127.0.0.2:{port}" in out
    assert re.search(r"1: \[weights\] stage 1: weight-update group megarl-weights-pp1-[0-9a-f]{8} at ", out)  # rank 1 on n2
    # rank 0 serves at the rendezvous address, which rank 1 on n2 reached already
    assert "megarl-server ready on http://127.0.0.2:" in (run / "servers" / "server0.log").read_text()
    assert [r["step"] for r in metric_rows(run)] == [1, 2]
