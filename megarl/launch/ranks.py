"""Which rank this process is, from the launcher's environment alone (torchrun, Open MPI, PMIx,
PMI, SLURM); no torch, so an entry point can ask "am I under a launcher?" before it imports torch.
`megarl.trainer.parallel` (torch.distributed and Megatron init) re-exports these names; its docstring gives
the discovery order and where the master address comes from.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from megarl.launch.hostlist import expand_nodelist
from megarl.common.net import LOOPBACK


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # torchrun | ompi | pmix | pmi | slurm | single


def discover_ranks(env: Optional[dict] = None) -> RankInfo:
    """Reads rank, world size and local rank from the launcher's environment variables."""
    env = os.environ if env is None else env

    def geti(name, default=None):
        return int(env[name]) if name in env else default

    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world, local, source = geti("RANK"), geti("WORLD_SIZE"), geti("LOCAL_RANK", 0), "torchrun"
    elif "OMPI_COMM_WORLD_RANK" in env:
        rank, world = geti("OMPI_COMM_WORLD_RANK"), geti("OMPI_COMM_WORLD_SIZE")
        local, source = geti("OMPI_COMM_WORLD_LOCAL_RANK", 0), "ompi"
    elif "PMIX_RANK" in env:
        rank = geti("PMIX_RANK")
        world = geti("SLURM_NTASKS") or _mpi4py_world_size()
        local, source = geti("SLURM_LOCALID", 0), "pmix"
    elif "PMI_RANK" in env:
        rank, world, local, source = geti("PMI_RANK"), geti("PMI_SIZE"), geti("MPI_LOCALRANKID", 0), "pmi"
    elif "SLURM_PROCID" in env:
        rank, world, local, source = geti("SLURM_PROCID"), geti("SLURM_NTASKS"), geti("SLURM_LOCALID", 0), "slurm"
    else:
        rank, world, local, source = 0, 1, 0, "single"
    if world is None:
        raise RuntimeError(f"parallel: launcher '{source}' gave a rank but no world size")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if "MASTER_ADDR" in env:
        addr = env["MASTER_ADDR"]
    elif nodelist:
        addr = expand_nodelist(nodelist)[0]
    else:
        addr = LOOPBACK
    port = geti("MASTER_PORT", 29500)
    return RankInfo(rank, world, local, addr, port, source)


def under_launcher(env: Optional[dict] = None) -> bool:
    """True under torchrun, srun or mpirun (anything :func:`discover_ranks` recognises)."""
    return discover_ranks(env).source != "single"


def _mpi4py_world_size() -> Optional[int]:
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD.Get_size()
