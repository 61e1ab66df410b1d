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

Two more kinds are released here. A TP group's message queue (`psm_*`, 24 MiB, made by the
group's rank 0 on any device): the colocated engine's shutdown unlinks it
(`release_message_queues`). A vLLM server's segments, cpushm and psm_, which its workers leave
when they are killed with SIGKILL: the server's stop removes them once its process group is gone
(`ServerSegments`, rollout/engines/server_process.py).
"""

from __future__ import annotations

import atexit
import os
import re
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


# vLLM's message queues between the ranks of a group (shm_broadcast.MessageQueue: a TP group's,
# an mp executor's) keep their ring buffer in Python's multiprocessing shared memory, /dev/shm/psm_*.
QUEUE_PREFIX = "psm_"
# `{VLLM_DIST_IDENT}-{group}-[{ranks}]-cpushm_{rank}`: a group's unique name (`tp:0`) has no '-'.
_SEGMENT_NAME = re.compile(r"(?P<identifier>.+)-[^-]+-\[[0-9-]+\]" + re.escape(SEGMENT_MARK) + r"_[0-9]+")


def release_message_queue(group) -> str | None:
    """Drop a vLLM group coordinator's message queue (`mq_broadcaster`), as vLLM's own
    `GroupCoordinator.destroy` does (the group then broadcasts through torch.distributed), and on
    the rank that created its ring buffer unlink the buffer's shared memory (24 MiB for a TP
    group), unregistered from Python's resource tracker. vLLM frees it only in the buffer's
    `__del__` (the group must live on: destroying vLLM's groups would destroy the trainer's world)
    or through the tracker at exit, which prints `resource_tracker: There appear to be 1 leaked
    shared_memory objects` and frees nothing when it is killed with the process tree. Every rank
    calls this (each closes its mapping). Returns the name unlinked: on the creator only."""
    queue = getattr(group, "mq_broadcaster", None)
    if queue is None:
        return None
    group.mq_broadcaster = None
    buffer = getattr(queue, "buffer", None)
    memory = getattr(buffer, "shared_memory", None)  # absent where a reader could not attach
    if memory is None:
        return None
    created, buffer.is_creator = buffer.is_creator, False  # its __del__ would unlink it a second time
    try:
        memory.close()
    except BufferError:  # a view of it is still alive: the mapping goes with the process
        pass
    if not created:
        return None
    try:
        memory.unlink()  # and unregisters it from the resource tracker
    except FileNotFoundError:
        from multiprocessing import resource_tracker

        resource_tracker.unregister(memory._name, "shared_memory")
        return None
    return memory.name


def release_message_queues() -> list[str]:
    """`release_message_queue` for every vLLM group of this process (TP, and any other with a
    queue), on any device. Returns the names unlinked here."""
    try:
        from vllm.distributed import parallel_state
    except ImportError:
        return []
    names = []
    for reference in list(parallel_state._groups.values()):
        group = reference()
        name = release_message_queue(group) if group is not None else None
        if name:
            names.append(name)
    return names


def segment_identifier(name: str) -> str | None:
    """The VLLM_DIST_IDENT a cpushm segment is named for (None for any other name)."""
    match = _SEGMENT_NAME.fullmatch(name)
    return match["identifier"] if match else None


def segments_mapped_by(pids, proc: Path = Path("/proc")) -> set[str]:
    """The vLLM segments (cpushm, and message queues' psm_) that the processes `pids` map."""
    names = set()
    for pid in pids:
        try:
            text = (proc / str(pid) / "maps").read_text()
        except OSError:  # ended meanwhile
            continue
        for line in text.splitlines():
            where = line.find(f"{SHM_DIR}/")
            if where >= 0:
                name = line[where + len(str(SHM_DIR)) + 1:].split(" ")[0]
                if SEGMENT_MARK in name or name.startswith(QUEUE_PREFIX):
                    names.add(name)
    return names


class ServerSegments:
    """The shared memory of a vLLM server's processes on this host, noted while they run and
    removed once they are gone. A server's workers name their cpushm segments after their
    executor's init method, which vLLM makes in the server's engine core (`vllm_dist_{uuid}` for
    the file store of vLLM's mp executor; the port where it rendezvouses over TCP): nothing this
    process chooses. So `note(pids)` reads which segments the server's processes map (every rank
    maps every rank's segment once the engine is up) and keeps their identifiers, and the message
    queues' psm_ segments they map; `remove()`, after the process group is reaped, unlinks the
    segments of those identifiers and the noted queues, all that no live process maps. A worker
    killed with SIGKILL never reaches the C++ destructor (cpushm) nor its resource tracker (psm_,
    killed with the group) that would have unlinked them."""

    def __init__(self, directory: Path = SHM_DIR, proc: Path = Path("/proc")):
        self.directory, self.proc = directory, proc
        self.identifiers: set[str] = set()
        self.queues: set[str] = set()

    def note(self, pids) -> None:
        for name in segments_mapped_by(pids, self.proc):
            identifier = segment_identifier(name)
            if identifier is not None:
                self.identifiers.add(identifier)
            elif name.startswith(QUEUE_PREFIX):
                self.queues.add(name)

    def remove(self) -> list[str]:
        """Unlink the noted segments that are still there and that no live process maps. Returns their names."""
        candidates = [path for identifier in sorted(self.identifiers) for path in run_segments(identifier, self.directory)]
        candidates += [self.directory / name for name in sorted(self.queues) if (self.directory / name).exists()]
        self.identifiers, self.queues = set(), set()
        if not candidates:
            return []
        in_use = mapped_segments(self.proc)
        removed = []
        for path in candidates:
            if path.name in in_use:
                continue
            try:
                path.unlink()
            except OSError:
                continue
            removed.append(path.name)
        return removed
