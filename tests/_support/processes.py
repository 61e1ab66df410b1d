"""Subprocess plumbing the tests share: the repository root, a free local port, the environment a
child process runs in and the command lines that start one (the CLI, a local torchrun).

    from _support.processes import REPO, child_env, cli_command, free_port, torchrun_command

    result = subprocess.run(torchrun_command(WORKER, 2, "--out", str(out)), env=child_env(),
                            capture_output=True, text=True, timeout=600)

Worker scripts started by file path do not have tests/ on sys.path; they keep their own REPO.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

from megatron_rl.runtime.launch_env import free_port  # the package's own; runtime.distributed re-exports it

__all__ = ["REPO", "child_env", "children_cpu_seconds", "cli_command", "free_port", "torchrun_command"]

REPO: Path = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    """os.environ with one OpenMP thread and the repository on PYTHONPATH, then `extra` on top
    (e.g. OMP_NUM_THREADS="2" or a longer PYTHONPATH)."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.update(extra)
    return env


def torchrun_command(script_or_module: str | os.PathLike, nproc: int, *args: str | os.PathLike,
                     module: bool = False) -> list[str]:
    """`python -m torch.distributed.run --nproc-per-node=NPROC --master-port=PORT SCRIPT ARGS...`:
    a single-node local launch on a fresh free master port; with module=True SCRIPT_OR_MODULE is a
    module name run as `-m MODULE`."""
    target = ["-m", str(script_or_module)] if module else [str(script_or_module)]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}", *target, *(str(arg) for arg in args)]


def cli_command(*args: str | os.PathLike) -> list[str]:
    """`python -m megatron_rl.cli ARGS...`."""
    return [sys.executable, "-m", "megatron_rl.cli", *(str(arg) for arg in args)]


def children_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process's finished children and theirs, so far.

    How "refused before any expensive work" is asserted: the difference around a child's run is
    the work it did, whatever else the machine runs (the suite's other worker, a loaded CI host),
    where its wall time is not."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
