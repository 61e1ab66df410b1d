#!/usr/bin/env bash
# The built-in agentic task (configs/tiny_agent.yaml) on this machine: the tiny Qwen3-MoE learns to
# multiply two 3-digit numbers by calling the `calculator` tool over several turns (multi-turn warm
# start on demonstrations, then DAPO with vLLM (CPU) rollouts). docs/agents.md explains the pieces.
#   bash launch/tiny_agent.sh [--nproc-per-node 2] [--dry-run] [key=value ...]
# Everything of the run goes to runs/tiny-agent/; run it again and it resumes from its last checkpoint.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MEGATRON_RL="${MEGATRON_RL_VENV:-$ROOT/.venv}/bin/megatron-rl"
[ -x "$MEGATRON_RL" ] || bash scripts/bootstrap.sh >&2  # first run: create .venv (a few minutes)
exec "$MEGATRON_RL" launch local --config configs/tiny_agent.yaml --output-dir runs/tiny-agent "$@"
