#!/usr/bin/env bash
# Multi-node torchrun launch of megarl-train. Run the same command on every node:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 GPUS_PER_NODE=8 launch/torchrun_multinode.sh CONFIG.yaml [a.b=c ...]
set -euo pipefail
: "${NNODES:=1}" "${NODE_RANK:=0}" "${MASTER_ADDR:=127.0.0.1}" "${MASTER_PORT:=29500}"
: "${GPUS_PER_NODE:=$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')}"
exec python -m torch.distributed.run \
  --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  -m megarl.train "$@"
