#!/usr/bin/env bash
# One command, one machine: megarl-train starts its own ranks (torchrun on loopback) and, when
# rollout.servers is empty, its own megarl CPU rollout servers.
#   launch/local.sh [CONFIG.yaml] [a.b=c ...]      (default: the tiny CPU GRPO demo)
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-configs/tiny_grpo.yaml}
shift || true
exec megarl-train "$config" "$@"
