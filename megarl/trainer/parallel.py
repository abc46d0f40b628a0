"""torch.distributed + Megatron model-parallel init from torchrun, SLURM or MPI environments.

Rank discovery order (first match wins): torchrun (RANK/WORLD_SIZE/LOCAL_RANK), Open MPI
(OMPI_COMM_WORLD_*), PMIx (PMIX_RANK, size from SLURM_NTASKS or mpi4py), PMI (PMI_RANK/PMI_SIZE),
SLURM (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID). MPI comes before SLURM because under
``mpirun`` inside a one-node sbatch job every rank sees SLURM_PROCID=0. The master address comes
from MASTER_ADDR, else the first host of the step's node list (SLURM_STEP_NODELIST: a trainer
step may run on a subset of the job's nodes), else of SLURM_JOB_NODELIST, else 127.0.0.1.

The result is a :class:`ParallelState` object passed to whoever needs groups or ranks; nothing
below this module reads Megatron's global getters.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from megarl.common import compat
from megarl.launch.hostlist import expand_nodelist  # noqa: F401 - megarl.trainer.parallel.expand_nodelist
from megarl.mcore.cpu import install_cpu_shim
from megarl.common.net import LOOPBACK, is_loopback, is_loopback_name, listening_socket, serve_store
from megarl.launch.ranks import RankInfo, discover_ranks, under_launcher  # noqa: F401 - megarl.trainer.parallel.*


def relaunch(nproc: int, module: str, argv: list[str]) -> int:
    """Re-executes ``python -m module argv`` as ``nproc`` local ranks (`megarl.launch.spawn`), so a user
    never has to know the launcher; returns the job's exit code."""
    from megarl.launch.spawn import run_ranks

    return run_ranks(nproc, module, argv)


@dataclass
class ParallelState:
    """Ranks and process groups of this process; passed around instead of global getters."""

    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    vpp: Optional[int] = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tp_group: Any = None
    pp_group: Any = None
    dp_group: Any = None
    mp_group: Any = None
    pp_global_ranks: list = field(default_factory=list)
    dp_global_ranks: list = field(default_factory=list)
    ep: int = 1  # expert-parallel size (MoE): experts split over ranks of the DP dimension
    ep_rank: int = 0
    ep_group: Any = None
    ep_global_ranks: list = field(default_factory=list)
    expert_dp_rank: int = 0  # rank among the replicas of this rank's experts
    cp: int = 1  # context-parallel size: each sequence split over the CP group
    cp_rank: int = 0
    cp_group: Any = None

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def first_replica(self) -> bool:
        """In the first copy of the model: DP rank 0 and CP rank 0 (the CP ranks of a DP rank
        hold the same weights, like DP replicas). Weight gathers, pushes and exports run here."""
        return self.dp_rank == 0 and self.cp_rank == 0

    @property
    def is_pp_source(self) -> bool:
        """The rank that serves this pipeline stage's weights (first replica, TP=0)."""
        return self.first_replica and self.tp_rank == 0

    @property
    def last_stage_rank(self) -> int:
        return self.pp_global_ranks[-1]


def init_distributed(backend: str = "auto", timeout_s: int = 600) -> RankInfo:
    """Initialises the default process group from the launcher environment (idempotent)."""
    info = discover_ranks()
    if dist.is_initialized():
        return info
    if backend == "auto":
        backend = "nccl" if compat.HAVE_CUDA else "gloo"
    if backend == "nccl":
        # Host tensors (the step's arrays, push statistics, stop flags) travel over gloo and CUDA
        # tensors over NCCL, in the default group and every group made from it; plain "nccl"
        # fails any collective on a CPU tensor ("No backend type associated with device type
        # cpu"), seen on the first GPU run (docs/gpu.md).
        backend = "cpu:gloo,cuda:nccl"
    if compat.HAVE_CUDA:
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
    else:
        install_cpu_shim()
    if info.source == "single" and "MASTER_PORT" not in os.environ:
        # one process, no launcher: nothing to meet, so no store listens (torch's TCP store binds
        # every interface, docs/reliability.md); MASTER_ADDR still names where servers bind
        os.environ.setdefault("MASTER_ADDR", LOOPBACK)
        dist.init_process_group(backend=backend, rank=0, world_size=1, store=dist.HashStore(),
                                timeout=timedelta(seconds=timeout_s))
        return RankInfo(0, 1, 0, LOOPBACK, 0, "single")
    os.environ.setdefault("MASTER_ADDR", info.master_addr)
    os.environ.setdefault("MASTER_PORT", str(info.master_port))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent serves the store (on every interface: torch's, not ours to bind)
        dist.init_process_group(
            backend=backend, rank=info.rank, world_size=info.world_size,
            init_method=f"tcp://{info.master_addr}:{info.master_port}",
            timeout=timedelta(seconds=timeout_s))
    else:
        dist.init_process_group(backend=backend, rank=info.rank, world_size=info.world_size,
                                store=rendezvous_store(info, timeout_s), timeout=timedelta(seconds=timeout_s))
    return info


def rendezvous_store(info: RankInfo, timeout_s: float):
    """The job's store: rank 0 serves it on the master address only (torch's own listener would
    bind every interface), the others join. A master name that resolves to loopback on its own
    host (a Debian-style ``127.0.1.1 node01`` line) while the other nodes reach it by its real
    address keeps torch's every-interface bind, said in one line."""
    if info.rank != 0:
        return dist.TCPStore(info.master_addr, info.master_port, info.world_size, is_master=False,
                             timeout=timedelta(seconds=timeout_s))
    host = info.master_addr
    if is_loopback(host) and not is_loopback_name(host):
        print(f"[parallel] MASTER_ADDR={host} resolves to loopback here: the rendezvous store "
              f"listens on every interface so other nodes reach it", flush=True)
        host = "0.0.0.0"
    return serve_store(listening_socket(host, info.master_port), info.world_size, timeout_s)


def init_model_parallel(tp: int, pp: int, vpp: Optional[int] = None, seed: int = 1234,
                        ep: int = 1, cp: int = 1) -> ParallelState:
    """Megatron ``initialize_model_parallel`` (DP derived: world / (tp * pp * cp); ``ep``
    expert-parallel ranks out of the DP dimension, experts never split over TP; ``cp`` ranks
    splitting each sequence) and the model-parallel RNG seeds."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(f"parallel.tp: world size {world} is not divisible by tp*pp*cp={tp * pp * cp}")
    if ep > 1 and cp > 1:
        raise ValueError("parallel.cp: context parallelism with expert parallelism (parallel.ep > 1) is not "
                         "supported; use parallel.cp=1 or parallel.ep=1")
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1 if ep > 1 else None, context_parallel_size=cp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    device = torch.device("cuda", torch.cuda.current_device()) if compat.HAVE_CUDA else torch.device("cpu")
    return ParallelState(
        rank=dist.get_rank(), world_size=world, tp=tp, pp=pp, dp=world // (tp * pp * cp),
        tp_rank=mpu.get_tensor_model_parallel_rank(), pp_rank=mpu.get_pipeline_model_parallel_rank(),
        dp_rank=mpu.get_data_parallel_rank(), vpp=vpp, device=device,
        tp_group=mpu.get_tensor_model_parallel_group(), pp_group=mpu.get_pipeline_model_parallel_group(),
        dp_group=mpu.get_data_parallel_group(), mp_group=mpu.get_model_parallel_group(),
        pp_global_ranks=_group_ranks(mpu.get_pipeline_model_parallel_group()),
        dp_global_ranks=_group_ranks(mpu.get_data_parallel_group()),
        ep=ep, ep_rank=mpu.get_expert_model_parallel_rank(),
        ep_group=mpu.get_expert_model_parallel_group(),
        ep_global_ranks=_group_ranks(mpu.get_expert_model_parallel_group()),
        expert_dp_rank=mpu.get_expert_data_parallel_rank(),
        cp=cp, cp_rank=mpu.get_context_parallel_rank(), cp_group=mpu.get_context_parallel_group())


def _group_ranks(group) -> list[int]:
    return [dist.get_global_rank(group, i) for i in range(dist.get_world_size(group))]


def destroy() -> None:
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def destroy_model_parallel_only() -> None:
    """Tears down Megatron's groups but keeps torch.distributed (to re-init another layout)."""
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
