"""Subprocess plumbing the tests share: the repository root, a free local port, the environment a
child process runs in and the command lines that start one (the CLI, a local torchrun).

    from _support.processes import REPO, child_env, cli_command, free_port, torchrun_command

    result = subprocess.run(torchrun_command(WORKER, 2, "--out", str(out)), env=child_env(),
                            capture_output=True, text=True, timeout=600)

Worker scripts started by file path do not have tests/ on sys.path; they keep their own REPO.

`preloaded=True` (cli_command, python_command, torchrun_command) forks the run from this pytest
worker's pre-imported server instead of starting Python afresh (zygote.py: what is the same,
what is not, and so which tests keep fresh processes): a tiny `megatron-rl train` spent 6-10 of
its 15 CPU-s importing torch, Megatron-Core and transformers. `children=True` as well: the Python
processes the run starts (a tool's torchrun and ranks, a benchmark's runs) are forked from it too.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

from _support import zygote
from megatron_rl.runtime.launch_env import free_port  # the package's own; runtime.distributed re-exports it

__all__ = ["REPO", "child_env", "children_cpu_seconds", "cli_command", "forked_python", "free_port", "python_command",
           "torchrun_command"]

REPO: Path = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    """os.environ with one OpenMP thread and the repository on PYTHONPATH, then `extra` on top
    (e.g. OMP_NUM_THREADS="2" or a longer PYTHONPATH)."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.update(extra)
    return env


def torchrun_command(script_or_module: str | os.PathLike, nproc: int, *args: str | os.PathLike,
                     module: bool = False, preloaded: bool = False, children: bool = False) -> list[str]:
    """`python -m torch.distributed.run --nproc-per-node=NPROC --master-port=PORT SCRIPT ARGS...`:
    a single-node local launch on a fresh free master port; with module=True SCRIPT_OR_MODULE is a
    module name run as `-m MODULE`. preloaded=True: the ranks forked from this worker's
    pre-imported server with torchrun's environment (zygote.py's `ranks`); children=True: their
    own Python children forked from it too."""
    target = ["-m", str(script_or_module)] if module else [str(script_or_module)]
    if preloaded and os.environ.get("MEGATRON_RL_TESTS_FRESH") != "1":
        return [sys.executable, "-S", str(_zygote.SCRIPT), "ranks", *(["--children"] if children else []),
                _zygote.socket(), str(nproc), str(free_port()), *target, *(str(arg) for arg in args)]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}", *target, *(str(arg) for arg in args)]


def cli_command(*args: str | os.PathLike, preloaded: bool = False, children: bool = False) -> list[str]:
    """`python -m megatron_rl.cli ARGS...`; preloaded=True: the same run forked from this pytest
    worker's pre-imported server (zygote.py says what differs from a fresh process); children=True:
    the Python processes it starts forked from the server too."""
    return python_command("-m", "megatron_rl.cli", *args, preloaded=preloaded, children=children)


def python_command(*argv: str | os.PathLike, preloaded: bool = False, children: bool = False) -> list[str]:
    """`python ARGV...`; preloaded=True: through zygote.py's client (the server starts on first use);
    children=True (with preloaded): the run's own Python children through it too (`run --children`).
    MEGATRON_RL_TESTS_FRESH=1 makes every run a fresh process (to rule the server out of a failure)."""
    argv = [str(arg) for arg in argv]
    if not preloaded or os.environ.get("MEGATRON_RL_TESTS_FRESH") == "1":
        return [sys.executable, *argv]
    return [sys.executable, "-S", str(_zygote.SCRIPT), "run", *(["--children"] if children else []),
            _zygote.socket(), *argv]


def forked_python() -> str:
    """An executable that stands for `python` with children=True (zygote.py's SHIM), for a script
    that takes its interpreter as a path (e.g. `PYTHON=... bash run.sh`); the interpreter itself
    under MEGATRON_RL_TESTS_FRESH=1."""
    if os.environ.get("MEGATRON_RL_TESTS_FRESH") == "1":
        return sys.executable
    return zygote.shim_path(_zygote.socket())


class _Zygote:
    """This pytest worker's pre-imported server (tests/_support/zygote.py), started on first use and
    stopped when the worker exits (SIGTERM: the server kills everything below it, then leaves); the
    server also stops when the worker is gone, however it ended. `preload` (module names) and `env`
    replace the server's imports and environment (tests of the server itself)."""

    SCRIPT = Path(__file__).with_name("zygote.py")

    def __init__(self, preload: tuple[str, ...] | None = None, env: dict[str, str] | None = None):
        self.process, self.path, self.preload, self.env = None, "", preload, env

    def socket(self) -> str:
        """The server's socket path; the server is started if it is not running."""
        if self.process is None or self.process.poll() is not None:
            self.start()
        return self.path

    def start(self) -> None:
        import atexit
        import shutil
        import subprocess
        import tempfile

        folder = tempfile.mkdtemp(prefix="zygote-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)  # runs after the stop below (last in, first out)
        self.path = os.path.join(folder, "socket")
        zygote.write_shim(self.path)
        self.log = open(os.path.join(folder, "server.log"), "wb")
        preload = [] if self.preload is None else ["--preload", *self.preload]
        self.process = subprocess.Popen([sys.executable, str(self.SCRIPT), "serve", self.path, str(os.getpid()),
                                         *preload], env=self.env or child_env(), stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        atexit.register(self.stop, self.process)

    @staticmethod
    def stop(process) -> None:
        """SIGTERM, then SIGKILL after 10 s. Not SIGKILL at once: the runs still going (a vLLM server
        a killed run had started) were left behind, the server gone before it could kill them."""
        import subprocess

        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


_zygote = _Zygote()


def children_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process's finished children and theirs, so far.

    How "refused before any expensive work" is asserted: the difference around a child's run is
    the work it did, whatever else the machine runs (the suite's other worker, a loaded CI host),
    where its wall time is not."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
