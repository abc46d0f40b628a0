"""The launch tier's session fixture: one real SLURM cluster (two fake nodes n1/n2 at 127.0.0.2 and
127.0.0.3, started by tools/slurm_ci/cluster.sh on free ports) for all tests, torn down at the end
(exactly the daemons it started). Skipped, with the reason, only where SLURM cannot run (not root,
no slurmctld and no apt-get, the packages cannot be installed)."""
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from launchkit import CLUSTER_SH, Slurm, free_port_run, clean_env  # noqa: E402


@pytest.fixture(scope="session")
def slurm():
    if os.geteuid() != 0:
        pytest.skip("the SLURM tier runs munged/slurmctld/slurmd and needs root")
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        pytest.skip("no slurmctld and no apt-get to install it")
    base = tempfile.mkdtemp(prefix="mrl-slurm-", dir="/tmp")  # short: munge's socket path is < 108 bytes
    port = free_port_run(3)
    env = clean_env(BASE=base, NUM_NODES="2", CTLD_PORT=str(port), SLURMD_PORT=str(port + 1))
    proc = subprocess.run(["bash", CLUSTER_SH, "start"], env=env, capture_output=True, text=True, timeout=600)
    try:
        if proc.returncode != 0:
            if "apt-get install" in proc.stdout and not shutil.which("slurmctld"):
                pytest.skip(f"SLURM could not be installed: {proc.stdout[-800:]}{proc.stderr[-800:]}")
            raise RuntimeError(f"cluster.sh start failed:\n{proc.stdout}\n{proc.stderr}")
        yield Slurm(base)
    finally:
        subprocess.run(["bash", CLUSTER_SH, "stop"], env=env, capture_output=True, text=True, timeout=120)
        shutil.rmtree(base, ignore_errors=True)

