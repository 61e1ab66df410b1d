#!/usr/bin/env bash
# GLM-4.5 355B-A32B on a SLURM cluster of 8-GPU Hopper nodes (configs/glm_4_5.yaml; read its header first):
# 16 training nodes and 8 rollout nodes (one server of TP 8 on each, serving FP8 weights).
# On a login node, after setting the recipe's paths (model.hf_config, checkpoint.init_from, data.*):
#   bash launch/glm_4_5.sh --partition gpu --account proj --time 24:00:00 [--dry-run] [key=value ...]
# Further options of `megatron-rl launch slurm` (--container-image, --module, --network-interface, ...)
# and config overrides pass through. Whole nodes (--exclusive): every CPU core of a node for its ranks
# or servers. The run directory is the recipe's output_dir.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MEGATRON_RL="${MEGATRON_RL_VENV:-$ROOT/.venv}/bin/megatron-rl"
[ -x "$MEGATRON_RL" ] || MEGATRON_RL=megatron-rl  # installed elsewhere: the one on PATH
exec "$MEGATRON_RL" launch slurm --config configs/glm_4_5.yaml \
    --nodes 16 --rollout-nodes 8 --gpus-per-node 8 --sbatch-arg=--exclusive --job-name glm-4.5 "$@"
