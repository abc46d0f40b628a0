#!/usr/bin/env bash
# MPI launch (Open MPI): ranks from OMPI_COMM_WORLD_*; MASTER_ADDR must name the first host.
#   NP=4 HOSTS=node0:2,node1:2 MASTER_ADDR=node0 launch/mpi.sh CONFIG.yaml [a.b=c ...]
set -euo pipefail
: "${NP:=2}" "${MASTER_ADDR:=127.0.0.1}" "${MASTER_PORT:=29500}"
hosts=()
[ -n "${HOSTS:-}" ] && hosts=(--host "$HOSTS")
exec mpirun -np "$NP" "${hosts[@]}" -x MASTER_ADDR="$MASTER_ADDR" -x MASTER_PORT="$MASTER_PORT" \
  -x OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" python -m megarl.train "$@"
