#!/usr/bin/env bash
# The olmo3 recipe (configs/olmo3.yaml) on this machine: Dr. GRPO advantages, token-level loss, clip
# 0.8/1.3, no KL, truncated importance sampling and the Olmo 3 prompt curriculum, on the tiny model.
#   bash launch/olmo3.sh [--nproc-per-node 2] [--dry-run] [key=value ...]
# Everything of the run goes to runs/olmo3/; run it again and it resumes from its last checkpoint.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MEGATRON_RL="${MEGATRON_RL_VENV:-$ROOT/.venv}/bin/megatron-rl"
[ -x "$MEGATRON_RL" ] || bash scripts/bootstrap.sh >&2  # first run: create .venv (a few minutes)
exec "$MEGATRON_RL" launch local --config configs/olmo3.yaml --output-dir runs/olmo3 "$@"
