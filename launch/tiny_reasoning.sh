#!/usr/bin/env bash
# The reasoning-length task (configs/tiny_reasoning.yaml) on this machine: the tiny Qwen3-MoE adds
# two 1-3 digit numbers with a check-and-retry trace; the learning curve shows length (correct /
# wrong) and entropy move under GRPO (docs/reproductions.md). Warm start, then RL with vLLM (CPU).
#   bash launch/tiny_reasoning.sh [--nproc-per-node 2] [--dry-run] [key=value ...]
# Everything of the run goes to runs/tiny-reasoning/; run it again and it resumes from its last checkpoint.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MEGATRON_RL="${MEGATRON_RL_VENV:-$ROOT/.venv}/bin/megatron-rl"
[ -x "$MEGATRON_RL" ] || bash scripts/bootstrap.sh >&2  # first run: create .venv (a few minutes)
exec "$MEGATRON_RL" launch local --config configs/tiny_reasoning.yaml --output-dir runs/tiny-reasoning "$@"
