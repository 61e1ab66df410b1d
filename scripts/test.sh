#!/usr/bin/env bash
# Set up the environment and run the whole test suite (extra arguments go to pytest).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
exec "${MEGATRON_RL_VENV:-$ROOT/.venv}/bin/python" -m pytest "$@"
