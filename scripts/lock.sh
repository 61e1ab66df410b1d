#!/usr/bin/env bash
# Re-resolve requirements/cpu.lock from pyproject.toml in a scratch venv (needs the registry).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT
"${PYTHON:-python3}" -m venv "$SCRATCH/venv"
"$SCRATCH/venv/bin/python" -m pip install --quiet "torch==2.13.0"
"$SCRATCH/venv/bin/python" -m pip install --quiet "$ROOT[dev]"
{
    echo "# Exact versions for CPU development and CI (Python 3.11). scripts/bootstrap.sh installs these,"
    echo "# then the package itself without dependencies. Regenerate with scripts/lock.sh."
    "$SCRATCH/venv/bin/python" -m pip freeze --exclude megatron-rl | sed 's/^torch==2.13.0+cpu$/torch==2.13.0/'
} > "$ROOT/requirements/cpu.lock"
echo "wrote requirements/cpu.lock"
