"""Helpers for the torchrun tier: real megatron-core over gloo on CPU, several ranks per test."""
import os
import subprocess
import sys

import pytest

from megarl.common.net import free_port  # noqa: F401  (re-exported for the tests)

HERE = os.path.dirname(os.path.abspath(__file__))


def torchrun(script: str, nproc: int, *args, timeout: int = 600) -> subprocess.CompletedProcess:
    """Runs tests/dist/<script> under torchrun on loopback; fails the test with the tail of the
    output if any rank fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           os.path.join(HERE, script), *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        pytest.fail(f"torchrun {script} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-6000:]}")
    return proc



from megarl.rollout.local import start_server  # noqa: E402,F401  (re-exported for the tests)
