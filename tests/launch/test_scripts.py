"""Every shell script the project ships parses (bash -n) and passes shellcheck."""
import glob
import os
import shutil
import subprocess

import pytest

from launchkit import REPO

SCRIPTS = sorted(glob.glob(os.path.join(REPO, "launch", "*.sh")) + [
    os.path.join(REPO, "launch", "slurm.sbatch"), os.path.join(REPO, "tools", "slurm_ci", "cluster.sh"),
    os.path.join(REPO, ".ci", "run")])


def test_the_script_list_is_complete():
    names = [os.path.relpath(p, REPO) for p in SCRIPTS]
    assert names == [".ci/run", "launch/local.sh", "launch/mpi.sh", "launch/slurm.sbatch",
                     "launch/torchrun_multinode.sh", "tools/slurm_ci/cluster.sh"]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: os.path.relpath(p, REPO))
def test_bash_n(path):
    proc = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(not shutil.which("shellcheck"), reason="shellcheck is not installed (apt shellcheck)")
@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: os.path.relpath(p, REPO))
def test_shellcheck(path):
    proc = subprocess.run(["shellcheck", "--shell=bash", path], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
