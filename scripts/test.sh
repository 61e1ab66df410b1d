#!/usr/bin/env bash
# Set up the environment and run the test suite (extra arguments go to pytest).
#   bash scripts/test.sh            the whole suite (what CI runs), on two pytest-xdist workers
#   bash scripts/test.sh --quick    the inner loop: only the tests that start no engine, no rank
#                                   group, no SLURM job and no child process (pyproject's marks)
# MEGATRON_RL_TEST_WORKERS sets the number of workers (0: none, in this process); more than the
# machine's cores makes timings and memory worse, not better. How modules are spread over the
# workers: tests/_support/scheduling.py.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
args=(-n "${MEGATRON_RL_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder)
for arg in "$@"; do
    if [[ "$arg" == "--quick" ]]; then
        args+=(-m "not engine and not multiprocess and not slurm and not subprocess")
    else
        args+=("$arg")
    fi
done
exec "${MEGATRON_RL_VENV:-$ROOT/.venv}/bin/python" -m pytest "${args[@]}"
