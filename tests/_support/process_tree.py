"""The process tree below a process, and its end: what the pre-imported server (zygote.py) uses so
that nothing it starts outlives it. Linux only (/proc, prctl).

    prctl(PR_SET_CHILD_SUBREAPER, 1)    # orphans below this process come to it, not to init
    kill_tree(pid)                      # pid, its session's process group and everything below pid
    kill_everything_below(os.getpid())  # until nothing is left

Below means by parent: a process in a session of its own (a vLLM server a run started with
start_new_session) is still below the run that started it, which a process-group kill misses.
Stdlib only: the server imports it beside itself.
"""

from __future__ import annotations

import os
import signal
import time

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36  # prctl(2)


def prctl(option: int, value: int) -> None:
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(option, ctypes.c_ulong(value), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value}) failed")


def reaped() -> list[tuple[int, int]]:
    """(pid, wait status) of every child of this process that has ended, without blocking."""
    ended = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.append((pid, status))


def below(root: int) -> list[int]:
    """The live processes below `root` (its children, theirs, ...), whatever session each is in."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                state, ppid = stat.read().rsplit(b")", 1)[1].split()[:2]
        except (OSError, ValueError):  # gone meanwhile
            continue
        if state != b"Z":  # a zombie's children have been handed on already
            children.setdefault(int(ppid), []).append(int(name))
    found, pending = [], [root]
    while pending:
        found.extend(next_level := children.get(pending.pop(), []))
        pending.extend(next_level)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL to `pid`, its process group and every process below it. A process forked meanwhile
    is orphaned to the nearest subreaper (the server), which kills it when it stops."""
    for target in [pid, *below(pid)]:
        _kill(target)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kill_everything_below(root: int, within_s: float = 10.0) -> None:
    """SIGKILL to every process below `root` (this process, a subreaper), again until none is left:
    what a kill orphans comes to `root` and is found by the next pass."""
    deadline = time.monotonic() + within_s
    while (left := below(root)) and time.monotonic() < deadline:
        for pid in left:
            _kill(pid)
        time.sleep(0.02)
        reaped()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
