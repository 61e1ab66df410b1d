#!/usr/bin/env bash
# Set up the environment and run the test suite (extra arguments go to pytest).
#   bash scripts/test.sh            the whole suite (what CI runs), in this process
#   bash scripts/test.sh --quick    the inner loop: only the tests that start no engine, no rank
#                                   group, no SLURM job and no child process (pyproject's marks)
# MEGATRON_RL_TEST_WORKERS=2 spreads the modules over two pytest-xdist workers
# (tests/_support/scheduling.py). Not the default yet: on two workers, two vLLM servers of
# tests/rollout/test_engine_failover.py once failed to start beside the other worker's engines.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
workers="${MEGATRON_RL_TEST_WORKERS:-0}"
args=()
if [[ "$workers" != 0 ]]; then
    args+=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
fi
for arg in "$@"; do
    if [[ "$arg" == "--quick" ]]; then
        args+=(-m "not engine and not multiprocess and not slurm and not subprocess")
    else
        args+=("$arg")
    fi
done
exec "${MEGATRON_RL_VENV:-$ROOT/.venv}/bin/python" -m pytest ${args[@]+"${args[@]}"}
