#!/usr/bin/env bash
# Qwen3-30B-A3B on a SLURM cluster of 8-GPU Hopper nodes (configs/qwen3_30b_a3b.yaml; read its header first):
# 4 training nodes and 2 rollout nodes (4 servers of TP 2 on each rollout node).
# On a login node, after setting the recipe's paths (model.hf_config, checkpoint.init_from, data.*):
#   bash launch/qwen3_30b_a3b.sh --partition gpu --account proj --time 24:00:00 [--dry-run] [key=value ...]
# Further options of `megatron-rl launch slurm` (--container-image, --module, --network-interface, ...)
# and config overrides pass through. Whole nodes (--exclusive): every CPU core of a node for its ranks
# or servers. The run directory is the recipe's output_dir.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MEGATRON_RL="${MEGATRON_RL_VENV:-$ROOT/.venv}/bin/megatron-rl"
[ -x "$MEGATRON_RL" ] || MEGATRON_RL=megatron-rl  # installed elsewhere: the one on PATH
exec "$MEGATRON_RL" launch slurm --config configs/qwen3_30b_a3b.yaml \
    --nodes 4 --rollout-nodes 2 --gpus-per-node 8 --sbatch-arg=--exclusive --job-name qwen3-30b-a3b "$@"
