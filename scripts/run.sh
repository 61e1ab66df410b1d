#!/usr/bin/env bash
# Set up the environment and run the main job on the built-in tiny default (CPU).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
exec "${MEGATRON_RL_VENV:-$ROOT/.venv}/bin/megatron-rl" train --output-dir runs/default "$@"
