#!/usr/bin/env bash
# The built-in code task (configs/tiny_code.yaml) on this machine: the tiny Qwen3-MoE learns to write
# a one-line Python expression that maps given inputs to outputs; the `code_tests` reward runs it in
# the sandbox on hidden test cases (docs/sandbox.md). Warm start, then RL with vLLM (CPU) rollouts.
#   bash launch/tiny_code.sh [--nproc-per-node 2] [--dry-run] [key=value ...]
# Everything of the run goes to runs/tiny-code/; run it again and it resumes from its last checkpoint.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MEGATRON_RL="${MEGATRON_RL_VENV:-$ROOT/.venv}/bin/megatron-rl"
[ -x "$MEGATRON_RL" ] || bash scripts/bootstrap.sh >&2  # first run: create .venv (a few minutes)
exec "$MEGATRON_RL" launch local --config configs/tiny_code.yaml --output-dir runs/tiny-code "$@"
