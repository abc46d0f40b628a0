#!/usr/bin/env bash
# megarl-train under MPI: Open MPI's mpirun, or `srun --mpi=pmix` inside a SLURM allocation. Ranks
# come from OMPI_COMM_WORLD_* or PMIX_RANK (megarl/trainer/parallel.py); torch.distributed meets at
# MASTER_ADDR:MASTER_PORT (MPI only starts the processes).
#
#   NP=4 HOSTS=node0:2,node1:2 launch/mpi.sh CONFIG.yaml [a.b=c ...]
#   MPI_LAUNCHER=srun NP=4 launch/mpi.sh CONFIG.yaml [a.b=c ...]     (inside salloc/sbatch)
#   MPIRUN_ARGS="--oversubscribe --mca btl self,tcp" NP=2 launch/mpi.sh ...   (extra launcher flags)
#
# NP (default 2); HOSTS (mpirun --host); MASTER_ADDR (default: the first host of HOSTS; under srun
# the first node of the allocation, by its SLURM NodeAddr; else 127.0.0.1); MASTER_PORT (default:
# derived from SLURM_JOB_ID inside a job, else a free port of this host); PYTHON (default python).
# mpirun forwards PATH PYTHONPATH VIRTUAL_ENV LD_LIBRARY_PATH OMP_NUM_THREADS CUDA_VISIBLE_DEVICES
# MASTER_ADDR MASTER_PORT and every NCCL_* GLOO_* TORCH_* MEGARL_* variable that is set (srun
# forwards the whole environment), and runs as root with --allow-run-as-root.
set -euo pipefail

NP=${NP:-2}
PY=${PYTHON:-python}
LAUNCHER=${MPI_LAUNCHER:-mpirun}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
[ $# -ge 1 ] || { sed -n '2,16p' "$0" >&2; exit 2; }
read -r -a extra <<<"${MPIRUN_ARGS:-}"

if [ -z "${MASTER_ADDR:-}" ]; then
  if [ -n "${HOSTS:-}" ]; then
    MASTER_ADDR=${HOSTS%%[:,]*}
  elif [ "$LAUNCHER" = srun ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)
    MASTER_ADDR=$(scontrol show node "$first" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
    MASTER_ADDR=${MASTER_ADDR:-$first}
  else
    MASTER_ADDR=127.0.0.1
  fi
fi
if [ -z "${MASTER_PORT:-}" ]; then
  if [ -n "${SLURM_JOB_ID:-}" ]; then
    MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
  else
    MASTER_PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
  fi
fi
export MASTER_ADDR MASTER_PORT

case "$LAUNCHER" in
  srun)
    cmd=(srun --mpi=pmix --ntasks="$NP" --label --kill-on-bad-exit=1) ;;
  mpirun)
    cmd=(mpirun -np "$NP")
    [ "$(id -u)" = 0 ] && cmd+=(--allow-run-as-root)
    [ -n "${HOSTS:-}" ] && cmd+=(--host "$HOSTS")
    for v in PATH PYTHONPATH VIRTUAL_ENV LD_LIBRARY_PATH OMP_NUM_THREADS CUDA_VISIBLE_DEVICES \
             MASTER_ADDR MASTER_PORT $(compgen -e | grep -E '^(NCCL|GLOO|TORCH|MEGARL)_' || true); do
      [ -n "${!v+set}" ] && cmd+=(-x "$v")
    done ;;
  *) echo "mpi.sh: MPI_LAUNCHER must be mpirun or srun, got $LAUNCHER" >&2; exit 2 ;;
esac
echo "[mpi.sh] $LAUNCHER: $NP ranks, rendezvous $MASTER_ADDR:$MASTER_PORT"
exec "${cmd[@]}" "${extra[@]}" "$PY" -m megarl.train "$@"
