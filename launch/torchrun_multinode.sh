#!/usr/bin/env bash
# Multi-node torchrun launch of megarl-train: the same command on every node, only the node rank differs.
#
#   launch/torchrun_multinode.sh --nnodes 2 --node-rank 0 --master-addr node0 [--master-port 29500] \
#       [--nproc-per-node 8] [--servers http://r0:30000,http://r1:30000 | --servers-file FILE] \
#       CONFIG.yaml [a.b=c ...]
#
# Each flag may come from the environment instead (flags win): NNODES NODE_RANK MASTER_ADDR
# MASTER_PORT NPROC_PER_NODE (default: this node's GPU count, 1 without GPUs) SERVERS SERVERS_FILE.
# Servers: a comma-separated URL list, or an address file with one URL per line (launch/slurm.sbatch
# and `python -m megarl.rollout.supervise wait --write FILE` write one once every server answers
# /health; the file is waited for, up to SERVERS_WAIT_S=600 s). They become the override
# rollout.servers=[...]. With neither, rollout.servers comes from the config; if that is empty,
# rank 0 starts CPU servers itself and serves them at MASTER_ADDR so that every node reaches them.
# Networks with several interfaces: set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the one that
# joins the nodes.
set -euo pipefail

usage() { sed -n '2,18p' "$0" >&2; exit 2; }
NNODES=${NNODES:-1} NODE_RANK=${NODE_RANK:-0} MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500} NPROC_PER_NODE=${NPROC_PER_NODE:-}
SERVERS=${SERVERS:-} SERVERS_FILE=${SERVERS_FILE:-} SERVERS_WAIT_S=${SERVERS_WAIT_S:-600}
PY=${PYTHON:-python}
while [ $# -gt 0 ]; do
  case "$1" in
    --nnodes) NNODES=$2; shift 2 ;;
    --node-rank) NODE_RANK=$2; shift 2 ;;
    --master-addr) MASTER_ADDR=$2; shift 2 ;;
    --master-port) MASTER_PORT=$2; shift 2 ;;
    --nproc-per-node) NPROC_PER_NODE=$2; shift 2 ;;
    --servers) SERVERS=$2; shift 2 ;;
    --servers-file) SERVERS_FILE=$2; shift 2 ;;
    -h|--help) usage ;;
    --*) echo "torchrun_multinode.sh: unknown flag $1" >&2; usage ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || usage
if [ -z "$NPROC_PER_NODE" ]; then
  NPROC_PER_NODE=$("$PY" -c 'import torch; print(max(torch.cuda.device_count(), 1))')
fi

if [ -n "$SERVERS_FILE" ]; then
  waited=0
  until [ -s "$SERVERS_FILE" ]; do
    if [ "$waited" -ge "$SERVERS_WAIT_S" ]; then
      echo "torchrun_multinode.sh: no server list in $SERVERS_FILE after ${SERVERS_WAIT_S}s" >&2
      exit 1
    fi
    sleep 1
    waited=$((waited + 1))
  done
  SERVERS=$(grep -v '^[[:space:]]*$' "$SERVERS_FILE" | paste -sd, -)
fi
servers=()
[ -n "$SERVERS" ] && servers=("rollout.servers=[$SERVERS]")

export MASTER_ADDR MASTER_PORT
echo "[torchrun_multinode] node $NODE_RANK/$NNODES x $NPROC_PER_NODE ranks, rendezvous $MASTER_ADDR:$MASTER_PORT${SERVERS:+, servers $SERVERS}"
exec "$PY" -m torch.distributed.run \
  --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$NPROC_PER_NODE" \
  --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \
  -m megarl.train "$@" "${servers[@]}"
