#!/usr/bin/env bash
# Kimi-K2 (1T) on a SLURM cluster of 8-GPU Hopper nodes (configs/kimi_k2.yaml; read its header first):
# 64 training nodes. The rollout servers (TP 16: two 8 x H200 nodes each) are yours to start; name
# them on the command line. On a login node, after setting the recipe's paths (model.hf_config,
# checkpoint.init_from, data.*):
#   bash launch/kimi_k2.sh --partition gpu --account proj --time 24:00:00 \
#       rollout.server_urls=[http://rollout-a:8000,http://rollout-b:8000] [--dry-run] [key=value ...]
# Further options of `megatron-rl launch slurm` (--container-image, --module, --network-interface, ...)
# and config overrides pass through. Whole nodes (--exclusive): every CPU core of a node for its ranks.
# The run directory is the recipe's output_dir.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MEGATRON_RL="${MEGATRON_RL_VENV:-$ROOT/.venv}/bin/megatron-rl"
[ -x "$MEGATRON_RL" ] || MEGATRON_RL=megatron-rl  # installed elsewhere: the one on PATH
exec "$MEGATRON_RL" launch slurm --config configs/kimi_k2.yaml \
    --nodes 64 --gpus-per-node 8 --sbatch-arg=--exclusive --job-name kimi-k2 "$@"
