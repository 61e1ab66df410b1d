#!/usr/bin/env bash
# The built-in tiny default (configs/tiny_cpu.yaml) on this machine: a 2-layer Qwen3-MoE learns to
# add two numbers, supervised warm start then DAPO with vLLM (CPU) rollouts, a few minutes on 2 cores.
#   bash launch/tiny_cpu.sh [--nproc-per-node 2] [--dry-run] [key=value ...]
# Everything of the run goes to runs/tiny-cpu/; run it again and it resumes from its last checkpoint.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MEGATRON_RL="${MEGATRON_RL_VENV:-$ROOT/.venv}/bin/megatron-rl"
[ -x "$MEGATRON_RL" ] || bash scripts/bootstrap.sh >&2  # first run: create .venv (a few minutes)
exec "$MEGATRON_RL" launch local --config configs/tiny_cpu.yaml --output-dir runs/tiny-cpu "$@"
