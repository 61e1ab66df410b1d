#!/usr/bin/env bash
# Set up the environment and run the test suite (extra arguments go to pytest).
#   bash scripts/test.sh            the whole suite (what CI runs)
#   bash scripts/test.sh --quick    the inner loop: only the tests that start no engine, no rank
#                                   group, no SLURM job and no child process (pyproject's marks)
# Two pytest-xdist workers by default, a test module (or a unit of modules that must share a
# worker) at a time: tests/_support/scheduling.py. MEGATRON_RL_TEST_WORKERS=0 runs in one process.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
# The suite starts hundreds of Python processes; where the environment says not to write
# bytecode, each of them compiled the package's modules again. Cached once, they load as .pyc.
unset PYTHONDONTWRITEBYTECODE
workers="${MEGATRON_RL_TEST_WORKERS:-2}"
args=()
if [[ "$workers" != 0 ]]; then
    args+=(-n "$workers")  # the units and their order: scheduling.py's scheduler
fi
for arg in "$@"; do
    if [[ "$arg" == "--quick" ]]; then
        args+=(-m "not engine and not multiprocess and not slurm and not subprocess")
    else
        args+=("$arg")
    fi
done
exec "${MEGATRON_RL_VENV:-$ROOT/.venv}/bin/python" -m pytest ${args[@]+"${args[@]}"}
