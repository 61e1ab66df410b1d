"""One training run per output directory at a time.

Two `megatron-rl train --output-dir D` at once both resumed from the same checkpoint and ran to the
end, writing every step's metrics twice into D/metrics.jsonl and their checkpoints over each
other's. So the run's driver (global rank 0) holds D/run.lock while it trains:

    {"host": ..., "pid": ..., "started": "2026-...", "slurm_job_id": "123" | null, ...}

created atomically (O_EXCL) before anything is written to D, and removed when the run ends (a
finished run, a stop signal's checkpoint-and-exit, an error). Another run that finds it:

* refuses to start, naming the holder, while the holder may be alive;
* takes it over, with one line, when the holder is certainly gone: it ran on this host (same
  host name and boot) and its process no longer exists (or its pid now belongs to a younger
  process);
* takes it over, with one line, when it is the same SLURM job on another node (a requeued job:
  SLURM ends every process of a job before it starts it again).

A holder on another host of another job cannot be checked from here: if that run is gone (its
node failed), the message says to delete the lock.

A lock whose content names no holder (not UTF-8 JSON, a key missing or of the wrong kind: a pid
that is not a process id) is unreadable: no run wrote it whole, so once it is older than a
partial write could be (`PARTIAL_GRACE_S`) it is taken over, with one line naming the file and
the key. Something other than a file in its place (a directory, a FIFO: never opened to wait on
it) refuses the run, naming it.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from megatron_rl.errors import ConfigError

LOCK = "run.lock"
PARTIAL_GRACE_S = 5.0  # an unreadable lock younger than this is being written by its holder
PID_MAX = 2**31 - 1  # pid_t's largest value


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: str  # wall-clock time the run took the lock, for people
    pid_start: int | None  # the process's start time in clock ticks since boot: a reused pid differs
    boot_id: str | None  # the host's boot: after a reboot every earlier process is gone
    slurm_job_id: str | None

    def describe(self) -> str:
        job = f", SLURM job {self.slurm_job_id}" if self.slurm_job_id else ""
        return f"pid {self.pid} on {self.host}{job}, started {self.started}"


def this_process(environ=os.environ) -> Holder:
    pid = os.getpid()
    return Holder(host=socket.gethostname(), pid=pid, started=time.strftime("%Y-%m-%d %H:%M:%S %z"),
                  pid_start=_process_start(pid), boot_id=_boot_id(), slurm_job_id=environ.get("SLURM_JOB_ID"))


class RunLock:
    """A held lock; `release()` removes it if it is still this process's, and the output directory
    too if taking the lock made it and the run left nothing else there (a run refused at start-up
    writes nothing)."""

    def __init__(self, path: Path, holder: Holder, made_directory: bool = False):
        self.path, self.holder, self.made_directory = path, holder, made_directory

    def release(self) -> None:
        try:
            ours = _read(self.path) == self.holder
        except ConfigError:
            return  # something else was put in its place: not ours to remove
        if ours:
            self.path.unlink(missing_ok=True)
            if self.made_directory:
                try:
                    self.path.parent.rmdir()  # only if empty
                except OSError:
                    pass


def acquire(directory: str | Path, notify: Callable[[str], None] = print, me: Holder | None = None) -> RunLock:
    """Hold `directory`/run.lock, taking over a dead holder's (module docstring); ConfigError
    naming the holder while it may still run."""
    directory = Path(directory)
    path, me = directory / LOCK, me or this_process()
    made_directory = not directory.exists()
    for _ in range(50):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            created = _create(path, me)
        except OSError as exc:
            raise ConfigError(f"cannot write into the output directory {directory} ({exc.strerror}): pass an "
                              "--output-dir this user can write to") from None
        if created:
            return RunLock(path, me, made_directory)
        content = _content(path)
        if content is None:
            continue  # released meanwhile
        holder = _parse(content, path)
        if isinstance(holder, str) and time.time() - _mtime(path) < PARTIAL_GRACE_S:
            time.sleep(0.1)  # its holder is writing it right now
            continue
        reason = holder if isinstance(holder, str) else stale_reason(holder, me)
        if reason is None:
            raise ConfigError(f"output directory {directory} is in use by another run: {holder.describe()} holds "
                              f"{path}. Two runs in one directory would resume from the same checkpoint and "
                              "write over each other's metrics and checkpoints: wait for it to end, stop it, or "
                              "pass another --output-dir. If that run is gone (its machine failed), delete "
                              f"{path}")
        if _replace(path, content, me):
            shown = "an unreadable lock" if isinstance(holder, str) else f"the lock of {holder.describe()}"
            notify(f"took over {shown} on {directory} ({reason})")
            return RunLock(path, me)
    raise ConfigError(f"could not take {path}: other runs keep taking and releasing it; start one run at a time")


def holder_of(directory: str | Path) -> Holder | None:
    """Who holds `directory`/run.lock now, if anyone (an unreadable lock: None; ConfigError when
    something other than a file is in its place)."""
    return _read(Path(directory) / LOCK)


def stale_reason(holder: Holder, me: Holder) -> str | None:
    """Why `holder` is certainly gone, or None when it may still run."""
    if holder.host == me.host and holder.boot_id == me.boot_id:
        if holder.pid == me.pid and holder.pid_start == me.pid_start:
            return "this very process took it before"
        if not _alive(holder.pid, holder.pid_start):
            return f"process {holder.pid} is no longer running"
        return None
    if holder.host == me.host:
        return "that host has rebooted since"
    if holder.slurm_job_id and holder.slurm_job_id == me.slurm_job_id:
        return f"SLURM job {me.slurm_job_id} was requeued onto {me.host}"
    return None


# ---- the file --------------------------------------------------------------------------------


def _create(path: Path, me: Holder) -> bool:
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(descriptor, "w") as handle:
        handle.write(_dump(me))
        handle.flush()
        os.fsync(handle.fileno())
    return True


def _replace(path: Path, seen: bytes, me: Holder) -> bool:
    """Put `me` in place of the stale lock whose content was `seen`; False if it changed meanwhile
    (another run took it over first)."""
    temporary = path.with_name(f".{path.name}.{me.pid}.tmp")
    temporary.write_text(_dump(me))
    if _content(path) != seen:
        temporary.unlink(missing_ok=True)
        return False
    os.replace(temporary, path)
    return _read(path) == me


def _dump(holder: Holder) -> str:
    return json.dumps(asdict(holder), indent=1) + "\n"


def _content(path: Path) -> bytes | None:
    """The lock file's bytes, None when there is none. Opened without waiting (a FIFO in its place
    would block a plain open) and refused unless it is a file."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read the run lock {path} ({exc.strerror}): remove it, or pass another "
                          "--output-dir") from None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise ConfigError(f"{path} is not a file (a directory, FIFO or device is in its place): a run lock is a "
                          "file a run writes; remove it, or pass another --output-dir")
    with os.fdopen(descriptor, "rb") as handle:
        return handle.read()


# Each key of the lock and what its value must be (`None` allowed where the run may not know it).
_KINDS = {"host": (str, False), "pid": (int, False), "started": (str, False), "pid_start": (int, True),
          "boot_id": (str, True), "slurm_job_id": (str, True)}


def _parse(content: bytes, path: Path) -> Holder | str:
    """The holder the lock's bytes name, or why they name none (with `path` and the key)."""
    try:
        fields = json.loads(content.decode("utf-8"))
    except (ValueError, RecursionError):  # not UTF-8 (UnicodeDecodeError is a ValueError), not JSON
        return f"{path} is not UTF-8 JSON"
    if not isinstance(fields, dict) or set(fields) != set(_KINDS):
        return f"{path} is not the JSON object a run writes (keys {', '.join(_KINDS)})"
    for key, (kind, optional) in _KINDS.items():
        value = fields[key]
        if not (isinstance(value, kind) and not isinstance(value, bool) or optional and value is None):
            return f"{path}: {key!r} is {_shown(value)}, not {'an integer' if kind is int else 'a string'}"
    if not 0 < fields["pid"] <= PID_MAX:
        return f"{path}: 'pid' is {_shown(fields['pid'])}, not a process id (1 to {PID_MAX})"
    return Holder(**fields)


def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _read(path: Path) -> Holder | None:
    content = _content(path)
    holder = None if content is None else _parse(content, path)
    return holder if isinstance(holder, Holder) else None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


# ---- processes of this host ------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat from field 3 (the state) on: the parenthesised command may hold spaces."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _process_start(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat: the start time in clock ticks since boot."""
    stat = _stat(pid)
    return None if stat is None else int(stat[19])


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _alive(pid: int, pid_start: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    stat = _stat(pid)
    if stat is None:
        return True  # no /proc here: the signal test is all there is
    if stat[0] == "Z":
        return False  # exited, not yet reaped by its parent
    return pid_start is None or int(stat[19]) == pid_start
