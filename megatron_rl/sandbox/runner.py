"""Run model-written Python in a sandbox: one fresh process per call, in its own user, mount,
PID, IPC, UTS and network namespaces (sandbox/launcher.py creates them and builds the jail).

What a call gets: a new, empty working directory (`/work`) holding the snippet and any files
given, and a `/tmp`, both on one tmpfs of the disk quota (gone with the call); the interpreter
and /usr read-only and nothing else of the host's files; a network namespace with only a
loopback that is down (no address is reachable, the host's 127.0.0.1 included); an environment
of PATH, HOME, TMPDIR and LANG only; limits on wall time, CPU seconds, memory (all its processes
together, SysV shared memory included), process count, file size, disk, open files and captured
output.
Whatever happens inside, the call returns a SandboxResult; the caller (a tool, a reward) never
sees an exception from the snippet.

Where the kernel refuses unprivileged user namespaces, `Sandbox(isolation="namespaces")` (the
default) raises SandboxUnavailable at construction, before any work. `isolation="none"` is the
explicit opt-out: the same limits and the clean environment and directory, but the snippet can
reach the network and every file this user can; use it only for code you would run yourself.
"""

from __future__ import annotations

import collections
import marshal
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from megatron_rl.sandbox.launcher import NAMESPACES

LAUNCHER = Path(__file__).with_name("launcher.py")
Isolation = Literal["namespaces", "none"]
# Can this process create the namespaces? (a child tries, as the launcher's child will)
PROBE = ("import ctypes, os\n"
         "libc = ctypes.CDLL(None, use_errno=True)\n"
         f"if libc.unshare({NAMESPACES}):\n"
         "    raise SystemExit(os.strerror(ctypes.get_errno()))\n")


class SandboxUnavailable(RuntimeError):
    """This machine cannot isolate a snippet as asked; the message says why and what to do."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_mb: int = 512  # all its processes together, and the address space of each one
    processes: int = 32  # processes and threads of the sandbox together
    output_bytes: int = 64 * 1024  # captured of stdout and of stderr each; more ends the call
    file_mb: int = 16  # the largest file it may write
    disk_mb: int = 64  # /work and /tmp together, the given files included (held in memory)
    disk_files: int = 4096  # files and directories in /work and /tmp together
    open_files: int = 64

    def __post_init__(self):
        for name in ("wall_seconds", "cpu_seconds", "memory_mb", "processes", "output_bytes", "file_mb", "disk_mb",
                     "disk_files", "open_files"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be a number > 0, got {value!r}")
        if self.processes < 2:
            raise ValueError("SandboxLimits.processes must be >= 2 (the interpreter and one child)")


@dataclass
class SandboxResult:
    """How one call ended. `status`: ok (exit 0), error (another exit code), timeout (wall time),
    cpu_limit, memory_limit (the snippet died of MemoryError, or its processes together held
    more than the limit and were killed), disk_limit (it failed with "No space left on device":
    the disk quota's bytes or files), output_limit (more output than the cap), killed (another
    signal), sandbox_error (the jail itself failed: not the snippet's doing; `stderr` says
    what). `memory_mb`: the most its processes held together at one of the readings every 10 ms
    (0 for a program that ended before the first; None without namespaces)."""

    status: str
    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    wall_seconds: float
    cpu_seconds: float | None = None
    memory_mb: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def namespaces_available() -> str | None:
    """None when this machine can run the namespace sandbox, else why not (one line)."""
    if sys.platform != "linux":
        return f"the sandbox needs Linux namespaces; this is {sys.platform}"
    try:
        probe = subprocess.run([os.path.realpath(sys.executable), "-I", "-S", "-c", PROBE], capture_output=True,
                               text=True, timeout=30, env=_host_env())
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"the namespace probe could not run: {error}"
    if probe.returncode != 0:
        return (f"the kernel refused unprivileged user, mount, PID and network namespaces "
                f"({probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else probe.returncode}; check sysctl "
                "kernel.unprivileged_userns_clone / user.max_user_namespaces, or the container's seccomp profile)")
    return None


@dataclass
class _Jail:
    """One launcher started ahead of its call: namespaces made and the jail built, waiting on
    `go` (its PID 1 reads the call's go and files from it before it starts the program)."""

    root: Path
    process: subprocess.Popen
    status: int  # read end of the status pipe
    go: int  # write end of the go pipe

    def discard(self) -> None:
        for fd in (self.go, self.status):
            if fd >= 0:
                os.close(fd)  # EOF on go: the launcher exits without running anything
        if self.process.poll() is None:
            _kill(self.process)
            self.process.wait()
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            stream.close()
        shutil.rmtree(self.root, ignore_errors=True)


class Sandbox:
    """Runs programs; see the module docstring. `warm`: jails kept built ahead of calls (the
    namespaces, mounts and the launcher's interpreter start are then off the call's path; a
    background thread builds the next one after each call). `close()` (or `with`) ends them."""

    def __init__(self, limits: SandboxLimits | None = None, *, isolation: Isolation = "namespaces", warm: int = 0):
        if isolation not in ("namespaces", "none"):
            raise ValueError(f"isolation must be 'namespaces' or 'none', got {isolation!r}")
        if isinstance(warm, bool) or not isinstance(warm, int) or warm < 0:
            raise ValueError(f"warm must be an integer >= 0, got {warm!r}")
        self.limits = limits or SandboxLimits()
        self.isolation = isolation
        self.warm = warm if isolation == "namespaces" else 0
        # calls by how they ended (SandboxResult.status), for the caller's metrics
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._ready: collections.deque[_Jail] = collections.deque()
        self._refills: set[threading.Thread] = set()  # threads building the next warm jails
        self._closed = False
        self.python = os.path.realpath(sys.executable)  # the base interpreter, not a venv's link
        if isolation == "namespaces":
            why = namespaces_available()
            if why is not None:
                raise SandboxUnavailable(
                    f"cannot sandbox model-written code on this machine: {why}. Either allow user namespaces, or "
                    "opt out explicitly with isolation 'none' (the same resource limits, but the code can use "
                    "the network and read or write every file this user can)")
        self._finalizer = weakref.finalize(self, _discard_all, self._ready)
        for _ in range(self.warm):
            self._ready.append(self._start_jail())

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            refills = list(self._refills)
        for thread in refills:  # a jail being built now is discarded by its thread
            thread.join()
        self._finalizer()

    def run_python(self, source: str, *, stdin: str = "", files: dict[str, str] | None = None) -> SandboxResult:
        """Run `source` as a Python program (`python -I -S main.py` in its work directory) with
        `stdin` as its standard input and `files` (relative name -> text) beside it."""
        program = _program_files(source, files, self.limits)
        if self.isolation == "none":
            work = Path(tempfile.mkdtemp(prefix="sandbox-work-"))
            try:
                _write_files(work, program)
                result = self._run_open(work, stdin.encode())
            finally:
                shutil.rmtree(work, ignore_errors=True)
        else:
            jail = self._take()
            try:
                result = self._run_jail(jail, stdin.encode(), program)
            finally:
                jail.discard()
                self._refill()
        with self._lock:
            self.counts[result.status] += 1
        return result

    # ---------------------------------------------------------------- the jail

    def _spec(self, root: Path) -> dict:
        limits = self.limits
        env = _program_env(home="/work", tmp="/tmp")
        return {"root": str(root), "ro": self._read_only_dirs(),
                "argv": [self.python, "-I", "-S", "/work/main.py"], "env": env,
                "limits": {"memory_bytes": limits.memory_mb << 20, "processes": limits.processes,
                           "file_bytes": limits.file_mb << 20, "open_files": limits.open_files,
                           "cpu_seconds": int(limits.cpu_seconds), "disk_bytes": limits.disk_mb << 20,
                           "disk_files": limits.disk_files}}

    def _start_jail(self) -> _Jail:
        root = Path(tempfile.mkdtemp(prefix="sandbox-root-"))
        status_read, status_write = os.pipe()
        go_read, go_write = os.pipe()
        spec = marshal.dumps(self._spec(root)).hex()
        try:
            process = subprocess.Popen(
                [self.python, "-I", "-S", str(LAUNCHER), spec, str(status_write), str(go_read)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=root, env=_host_env(),
                pass_fds=(status_write, go_read), start_new_session=True)  # its own group: killed as one
        except BaseException:
            for fd in (status_read, go_write):
                os.close(fd)
            shutil.rmtree(root, ignore_errors=True)
            raise
        finally:
            os.close(status_write)
            os.close(go_read)
        return _Jail(root, process, status_read, go_write)

    def _take(self) -> _Jail:
        with self._lock:
            if self._closed:
                raise RuntimeError("this Sandbox is closed")
            if self._ready:
                return self._ready.popleft()
        return self._start_jail()

    def _refill(self) -> None:
        """Start the next warm jail on a thread: the caller does not wait for it."""
        def start():
            jail = None
            try:
                jail = self._start_jail()
                with self._lock:
                    if not self._closed:
                        self._ready.append(jail)
                        jail = None
            finally:
                if jail is not None:  # closed meanwhile
                    jail.discard()
                with self._lock:  # last: close() joins this thread until the jail is placed or gone
                    self._refills.discard(threading.current_thread())

        with self._lock:
            if self._closed or len(self._ready) + len(self._refills) >= self.warm:
                return
            thread = threading.Thread(target=start, daemon=True)
            self._refills.add(thread)
        thread.start()

    def _run_jail(self, jail: _Jail, stdin: bytes, program: dict[str, bytes]) -> SandboxResult:
        def go():
            try:
                data = marshal.dumps(program)
                with open(jail.go, "wb", closefd=False) as pipe:  # the whole of it, however large
                    pipe.write(b"g" + len(data).to_bytes(8, "little") + data)
            except OSError:
                pass  # the launcher already failed; its stderr says why
            os.close(jail.go)
            jail.go = -1

        ended = _supervise(jail.process, stdin, self.limits, start=go)
        with os.fdopen(jail.status, "rb") as pipe:
            data = pipe.read()
        jail.status = -1
        return _result(ended, marshal.loads(data) if data else None, True, self.limits)

    # ---------------------------------------------------------------- the opt-out

    def _run_open(self, work: Path, stdin: bytes) -> SandboxResult:
        env = _program_env(home=str(work), tmp=str(work))
        process = subprocess.Popen([self.python, "-I", "-S", str(work / "main.py")], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=work, env=env,
                                   preexec_fn=_limiter(self.limits), start_new_session=True)
        return _result(_supervise(process, stdin, self.limits), None, False, self.limits)

    def _read_only_dirs(self) -> list[str]:
        """The host directories the snippet sees (read-only): /usr, and the interpreter's prefix
        when it lives elsewhere (pyenv, conda, a custom build)."""
        dirs = ["/usr"]
        for prefix in (sys.base_prefix, os.path.dirname(os.path.dirname(self.python))):
            prefix = os.path.realpath(prefix)
            if not any(prefix == d or prefix.startswith(d + "/") for d in dirs):
                dirs.append(prefix)
        return dirs


def _discard_all(ready: collections.deque) -> None:
    while ready:
        ready.popleft().discard()


def _program_files(source: str, files: dict[str, str] | None, limits: SandboxLimits) -> dict[str, bytes]:
    """{relative path: bytes}: main.py, then `files`, checked before any jail is used: each name
    inside the work directory, all of them within the disk quota."""
    program = {"main.py": source.encode()}
    for name, text in (files or {}).items():
        path = PurePosixPath(name)
        if path.is_absolute() or not path.parts or ".." in path.parts:
            raise ValueError(f"sandbox file {name!r} is outside the work directory")
        program[str(path)] = text.encode()
    size = sum(len(data) for data in program.values())
    if size > limits.disk_mb << 20 or len(program) > limits.disk_files:
        raise ValueError(f"the sandbox's program and files ({len(program)} files, {size} bytes) are more than "
                         f"SandboxLimits.disk_mb ({limits.disk_mb} MB) or disk_files ({limits.disk_files}) allow")
    return program


def _write_files(work: Path, program: dict[str, bytes]) -> None:
    for name, data in program.items():
        path = work / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


@dataclass
class _Ended:
    returncode: int
    stdout: str
    stderr: str
    wall_seconds: float
    timed_out: bool
    overflowed: bool


def _supervise(process, stdin: bytes, limits: SandboxLimits, start=None) -> _Ended:
    """Capture the output (capped), arm the wall limit, call `start` (a warm jail's go), feed
    stdin and wait. The timer kills at the wall limit while wait() blocks in waitpid:
    Popen.wait(timeout=) polls with sleeps growing to 50 ms, which added up to 50 ms to every
    call that ran longer."""
    overflow = threading.Event()
    out, err = bytearray(), bytearray()
    readers = [threading.Thread(target=_capture, args=(pipe, sink, limits.output_bytes, overflow, process),
                                daemon=True) for pipe, sink in ((process.stdout, out), (process.stderr, err))]
    for reader in readers:
        reader.start()
    timed_out = threading.Event()
    timer = threading.Timer(limits.wall_seconds, lambda: (timed_out.set(), _kill(process)))
    timer.daemon = True
    # The clock starts before the timer, so that a call killed at the wall limit never reports
    # less than the limit (on a loaded machine the timer's thread can start late).
    started = time.perf_counter()
    timer.start()
    if start is not None:
        start()
    _feed(process, stdin)
    process.wait()
    timer.cancel()
    wall = time.perf_counter() - started
    for reader in readers:
        reader.join(timeout=5)
    return _Ended(process.returncode, out.decode(errors="replace"), err.decode(errors="replace"), wall,
                  timed_out.is_set(), overflow.is_set())


def _program_env(home: str, tmp: str) -> dict[str, str]:
    """The program's whole environment: nothing of the trainer's is inherited."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": tmp, "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1"}


def _host_env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}


def _limiter(limits: SandboxLimits):
    """preexec_fn of the opt-out path: the limits without namespaces."""
    import resource

    def apply():
        for name, value in (("RLIMIT_AS", limits.memory_mb << 20), ("RLIMIT_FSIZE", limits.file_mb << 20),
                            ("RLIMIT_NOFILE", limits.open_files), ("RLIMIT_CORE", 0)):
            resource.setrlimit(getattr(resource, name), (value, value))
        resource.setrlimit(resource.RLIMIT_CPU, (int(limits.cpu_seconds), int(limits.cpu_seconds) + 1))
        # RLIMIT_NPROC is per real user here, not per sandbox: with this user's other processes
        # counted it would refuse the interpreter itself, so the opt-out path leaves it unset.
    return apply


def _capture(pipe, sink: bytearray, cap: int, overflow: threading.Event, process) -> None:
    """Keep the first `cap` bytes; past them, end the call (a flood of output is a limit, not a
    result) and drain what is left so the process never blocks on a full pipe."""
    while True:
        chunk = pipe.read1(65536)
        if not chunk:
            return
        room = cap - len(sink)
        if room > 0:
            sink += chunk[:room]
        if len(chunk) > room and not overflow.is_set():
            overflow.set()
            _kill(process)


def _feed(process, data: bytes) -> None:
    try:
        if data:
            process.stdin.write(data)
        process.stdin.close()
    except (BrokenPipeError, OSError):
        pass  # the snippet did not read it all: its business


def _kill(process) -> None:
    try:
        # the launcher's group: itself, its child and the jail's PID 1, whose death ends the rest
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _result(ended: _Ended, report: dict | None, inside: bool, limits: SandboxLimits) -> SandboxResult:
    memory = report["memory_peak_kb"] / 1024 if report else None

    def result(status, exit_code=None, sig=None, cpu=None):
        return SandboxResult(status, exit_code, sig, ended.stdout, ended.stderr, ended.wall_seconds, cpu, memory)

    if ended.overflowed:
        return result("output_limit")
    if ended.timed_out:
        return result("timeout")
    returncode = ended.returncode
    if inside:
        if report is None:  # the launcher could not build the jail (its stderr line says why)
            return result("sandbox_error", exit_code=returncode)
        code, sig, cpu = report.get("exit_code"), report.get("signal"), report.get("cpu_seconds")
        if report["memory_exceeded"]:  # its processes together held more than the limit: PID 1 killed them
            return result("memory_limit", exit_code=code, sig=sig, cpu=cpu)
    else:
        code, sig, cpu = (returncode, None, None) if returncode >= 0 else (None, -returncode, None)
    if sig is not None:
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu is not None and cpu >= limits.cpu_seconds):
            return result("cpu_limit", sig=sig, cpu=cpu)
        return result("killed", sig=sig, cpu=cpu)
    if code == 0:
        return result("ok", exit_code=0, cpu=cpu)
    if "MemoryError" in ended.stderr[-2000:]:
        return result("memory_limit", exit_code=code, cpu=cpu)
    if "No space left on device" in ended.stderr[-2000:]:  # ENOSPC: the disk quota's bytes or files
        return result("disk_limit", exit_code=code, cpu=cpu)
    return result("error", exit_code=code, cpu=cpu)
