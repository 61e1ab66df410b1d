#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment for CPU work.
# The venv is rebuilt only when pyproject.toml or requirements/cpu.lock change: their hash is
# stored in the venv and compared on every run, so repeated runs start in a second.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_RL_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "error: megatron-rl needs Python >= 3.11; '$PYTHON' is $("$PYTHON" --version 2>&1). Set PYTHON=python3.11." >&2
    exit 1
fi

HASH="$(cat "$ROOT/pyproject.toml" "$ROOT/requirements/cpu.lock" | sha256sum | cut -d' ' -f1)"
if [[ -f "$VENV/.megatron-rl-stamp" && "$(cat "$VENV/.megatron-rl-stamp")" == "$HASH" ]]; then
    echo "environment: reusing $VENV (lock unchanged)"
    exit 0
fi

echo "environment: creating $VENV (first run or lock changed; about a minute)"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch first and exactly: a bare or newer requirement would pull a multi-GB CUDA build.
"${PIP[@]}" "torch==2.13.0"
# --no-deps: the lock is complete, and it deliberately leaves out packages some dependencies
# declare but that must not be installed here (see scripts/lock.sh).
"${PIP[@]}" --no-deps -r "$ROOT/requirements/cpu.lock"
"${PIP[@]}" --no-deps -e "$ROOT"
echo "$HASH" > "$VENV/.megatron-rl-stamp"
echo "environment: ready"
