"""Shared memory of vLLM's colocated CPU engines: one name per run, and stale segments removed.

vLLM's CPU build communicates between the ranks of one engine through POSIX shared memory named
`{VLLM_DIST_IDENT}-{group}-[{ranks}]-cpushm_{rank}` in /dev/shm, and its CPU worker sets
VLLM_DIST_IDENT from the executor's init method (vllm/v1/worker/cpu_worker.py). Colocated engines
join the trainer's world through vLLM's external launcher, whose init method is always `env://`,
so every colocated run on a host used the same names: a run killed with SIGKILL left its segments
behind and every later run failed at engine start with `create shm in SHMManager failed. errno:
17` (EEXIST); two runs at once on one host collided the same way.

Here each run gets its own identifier (made on global rank 0, broadcast to the others), handed to
vLLM as the init method's file name, which the CPU worker turns into VLLM_DIST_IDENT. The init
method is otherwise unused: the trainer's process group exists before the engine, so vLLM never
initializes one from it. Before an engine starts, one process per host removes the cpushm
segments that no process on the host has mapped (a run that died without unlinking them), and
says which.

A run also removes its own (`RunSegments`). vLLM unlinks them only in its SHMManager's C++
destructor (csrc/cpu/shm.cpp, `destroy_shm`: every rank unlinks every rank's name), which runs
among the shared library's static destructors at C `exit()`, never at an engine shutdown (no op
frees a manager): a process that ends with `os._exit` (a fork of the tests' pre-imported server,
tests/_support/zygote.py), or whose interpreter dies at exit, leaves them in /dev/shm, 4 MiB and
more each. So every rank of an engine, when the engine shuts down and otherwise at the process's
exit (atexit, which a fork's `os._exit` path still runs), unlinks the segments named
`{identifier}-...-cpushm_*` on its host: its own run's only, whoever of the ranks made them. The
other ranks may still map them; that is safe, and vLLM opens a segment by name only while the
engine starts (`init_shm_manager` / `join_shm_manager`, then a barrier on every rank), and a later
engine gets a new identifier. Only vLLM's AVX-512 kernel libraries (`_C`, `_C_AVX512`; with AMX
or without) have these ops; with `_C_AVX2` vLLM's CPU communicator uses torch.distributed and
makes no segment.
"""

from __future__ import annotations

import atexit
import os
import secrets
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

SHM_DIR = Path("/dev/shm")
RUN_PREFIX = "megatron-rl-"
SEGMENT_MARK = "-cpushm"
# A segment exists for a moment between its creation and its creator's mmap: one younger than
# this is left alone, whoever made it.
MIN_STALE_AGE_S = 10.0


def run_identifier() -> str:
    """The same new identifier on every rank (collective when a process group exists)."""
    import torch.distributed as dist

    identifier = [f"{RUN_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(identifier, src=0)
    return identifier[0]


@contextmanager
def segments_named_for(identifier: str) -> Iterator[None]:
    """While an engine is built: vLLM's external launcher hands its workers an init method whose
    file name is `identifier`, so their shared memory is `{identifier}-...-cpushm_*`."""
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    original = ExecutorWithExternalLauncher._distributed_args

    def distributed_args(executor):
        _, rank, local_rank = original(executor)
        return f"file://{SHM_DIR / identifier}", rank, local_rank

    ExecutorWithExternalLauncher._distributed_args = distributed_args
    try:
        yield
    finally:
        ExecutorWithExternalLauncher._distributed_args = original


def mapped_segments(proc: Path = Path("/proc")) -> set[str]:
    """Names of the /dev/shm files some process on this host has mapped (those we may read)."""
    names = set()
    for maps in proc.glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process ended, or belongs to another user
            continue
        for line in text.splitlines():
            where = line.find(f"{SHM_DIR}/")
            if where >= 0:
                names.add(line[where + len(str(SHM_DIR)) + 1:].split(" ")[0])
    return names


def stale_segments(directory: Path = SHM_DIR, proc: Path = Path("/proc"), now: float | None = None) -> list[Path]:
    """vLLM CPU shared-memory segments (ours or any run's) that no live process maps."""
    try:
        candidates = [path for path in directory.iterdir() if SEGMENT_MARK in path.name]
    except OSError:
        return []
    if not candidates:
        return []
    now = time.time() if now is None else now
    in_use = mapped_segments(proc)
    stale = []
    for path in candidates:
        try:
            old_enough = now - path.stat().st_mtime >= MIN_STALE_AGE_S
        except OSError:
            continue
        if old_enough and path.name not in in_use:
            stale.append(path)
    return sorted(stale)


def remove_stale_segments(notify: Callable[[str], None], directory: Path = SHM_DIR) -> list[str]:
    """Unlink the stale segments; one line names them. Returns the names removed."""
    removed, sizes = [], 0
    for path in stale_segments(directory):
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError:  # another user's, or gone meanwhile
            continue
        removed.append(path.name)
        sizes += size
    if removed:
        notify(f"removed {len(removed)} stale vLLM shared-memory segment(s) ({sizes / 2**20:.0f} MiB) in {directory} "
               f"that no process maps, left by a run that ended without cleaning up: {', '.join(removed)}")
    return removed


def run_segments(identifier: str, directory: Path = SHM_DIR) -> list[Path]:
    """The segments vLLM made for the run (or engine) `identifier`: `{identifier}-{group}-[{ranks}]-cpushm_{rank}`.
    The identifier's fixed-width random part keeps another run's names out."""
    try:
        return sorted(path for path in directory.iterdir()
                      if path.name.startswith(f"{identifier}-") and SEGMENT_MARK in path.name)
    except OSError:
        return []


def remove_run_segments(identifier: str, directory: Path = SHM_DIR) -> list[str]:
    """Unlink this run's segments on this host (any rank's; mapped ones too). Returns the names removed."""
    removed = []
    for path in run_segments(identifier, directory):
        try:
            path.unlink()
        except OSError:  # another rank of the run unlinked it first
            continue
        removed.append(path.name)
    return removed


class RunSegments:
    """The shared memory of one engine's run: removed by `release()` (the engine's shutdown) or,
    failing that, when the process exits (atexit, registered here: an engine that fails while it
    starts, or is never shut down, leaves nothing either). A child forked from the rank inherits
    the atexit entry but not the engine: its exit removes nothing."""

    def __init__(self, identifier: str, directory: Path = SHM_DIR):
        self.identifier, self.directory = identifier, directory
        self.removed: list[str] = []
        self._released = False
        self._pid = os.getpid()
        atexit.register(self.release)

    def release(self) -> list[str]:
        """Unlink the run's segments on this host, once. Returns the names this call removed."""
        if self._released or os.getpid() != self._pid:
            return []
        self._released = True
        atexit.unregister(self.release)
        self.removed = remove_run_segments(self.identifier, self.directory)
        return self.removed
