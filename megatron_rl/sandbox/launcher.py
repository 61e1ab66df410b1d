"""The sandbox's inside half, started by sandbox/runner.py once per call:
`python -I -S launcher.py SPEC STATUS_FD GO_FD`, under the base interpreter, standard library only (it
imports nothing of the project and nothing from site-packages, and nothing slow: it starts once
per call). SPEC is a hex-encoded marshal of {"root": an empty dir to build the new root on,
"ro": [host dirs shown read-only], "argv": [...], "env": {...}, "limits": {...}}.

Three processes, and why (we may run as real root, and then uid 0 inside maps to uid 0 outside:
ownership alone protects nothing):
- this one stays outside and writes the id maps of the new user namespace (only a process in
  the parent namespace may map more than its own id). As real root, uid/gid 0 -> 0 (the jail is
  built with root's view of the host's files) and SNIPPET_ID -> nobody, which the snippet runs
  as: the kernel exempts real root from the process limit. As anyone else: 0 -> that user.
- its child unshares the user, mount, PID, network, IPC and UTS namespaces;
- the child's child is PID 1 of the new PID namespace. It builds the jail: a tmpfs becomes the
  new root, holding read-only binds of /usr and the interpreter's directories, `/work` and `/tmp`
  (two directories of one size- and file-count-limited tmpfs: the disk quota, in memory, never
  the host's disk), and /dev/{null,zero,urandom,random}; pivot_root and detaching the old root
  leave no path to the host's files in this mount namespace at all (a chroot alone can be
  escaped by anyone holding CAP_SYS_CHROOT, which a nested user namespace grants). It keeps a
  /proc of the new PID namespace open for itself only (mounted, opened, detached) and caps, in
  the new namespaces, what the program could make outside its address space: SysV shared memory
  at the memory limit in all, with segments nobody attaches freed (shm_rmid_forced); a few
  message queues and semaphores; no user namespace of its own (max_user_namespaces 0: a nested
  one would allow a tmpfs or an IPC namespace of any size); few inotify watches. The network
  namespace has a loopback that is down: nothing is reachable. Then it waits on GO_FD for the
  call's go and its files (a jail can be built ahead of its call; EOF: exit unused), and writes
  them into /work, owned by the snippet's id.
- the snippet is PID 2: resource limits (address space, CPU seconds, processes, file size, open
  files, no locked memory or POSIX message queues; the process count is per user namespace, so
  it counts this sandbox only), every capability dropped (bounding set emptied, SECBIT_NOROOT
  locked, then the snippet's own uid, no_new_privs), so nothing can remount a read-only bind
  writable (a nested user namespace gives capabilities over copies of these mounts only, whose
  read-only flag the kernel locks); a seccomp filter refusing (EPERM) memfd_create,
  memfd_secret, io_uring_setup and bpf, whose memory no limit above counts (the syscalls of
  another ABI, x32 or 32-bit, are refused too); then exec with the given environment only.
  PID 1 reaps every orphan until the snippet ends and, every WATCH_SECONDS meanwhile (sooner
  while memory grows toward the limit: next_reading_in), adds up the resident memory of all the
  sandbox's processes and its SysV segments: above the memory limit it kills them all (the
  address-space limit is per process; this one counts them together). Then it writes how the snippet ended (a marshalled dict) to the status pipe (the
  snippet's copy is closed), and exits, which kills every process left in the namespace.

No status written (exit 121-127, a line on stderr): the jail could not be built; the runner
reports it as a sandbox failure, never as the snippet's."""

import ctypes
import marshal
import os
import resource
import select
import sys
import time

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
SIGKILL = 9  # (the signal module imports enum: ~10 ms of start-up)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = (
    1, 4, 22, 24, 28, 38)
SECBIT_NOROOT, SECBIT_NOROOT_LOCKED = 1, 2
# user, mount, PID, network, IPC and UTS namespaces
NAMESPACES = 0x10000000 | 0x00020000 | 0x20000000 | 0x40000000 | 0x08000000 | 0x04000000
SNIPPET_ID, NOBODY = 1, 65534  # as real root: the snippet's uid/gid inside, and what it is outside
# Per machine: the seccomp audit arch and the syscall numbers we use or filter (the numbers from
# 424 on are the same on every architecture; socketcall exists on ppc64le and s390x only).
MACHINES = {
    "x86_64": {"audit_arch": 0xC000003E, "pivot_root": 155, "memfd_create": 319, "bpf": 321, "setsockopt": 54,
               "fcntl": 72},
    "aarch64": {"audit_arch": 0xC00000B7, "pivot_root": 41, "memfd_create": 279, "bpf": 280, "setsockopt": 208,
                "fcntl": 25},
    "ppc64le": {"audit_arch": 0xC0000015, "pivot_root": 203, "memfd_create": 360, "bpf": 361, "setsockopt": 339,
                "fcntl": 55, "socketcall": 102},
    "s390x": {"audit_arch": 0x80000016, "pivot_root": 217, "memfd_create": 350, "bpf": 351, "setsockopt": 366,
              "fcntl": 55, "socketcall": 102},
}
COMMON_SYSCALLS = {"io_uring_setup": 425, "memfd_secret": 447}
# memory no limit would count (memfd files, io_uring rings, BPF maps); socketcall hides its
# arguments from the filter below
REFUSED_SYSCALLS = ("memfd_create", "bpf", "io_uring_setup", "memfd_secret", "socketcall")
SOL_SOCKET, SOCKET_BUFFER_OPTIONS = 1, (7, 8, 32, 33)  # SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE
F_SETPIPE_SZ = 1031
X32_SYSCALL_BIT = 0x40000000  # x86_64's other ABI: the same audit arch, numbers with this bit set
WATCH_SECONDS = 0.01  # how often PID 1 adds up the sandbox's memory
# ... and how soon at the soonest, while memory grows fast enough to pass the limit before then
WATCH_SECONDS_GROWING = 0.001
PROC = "/.proc"  # where PID 1's /proc is mounted while the jail is built (then detached)
# statvfs flags a user namespace may not clear on a bind of a host mount (the kernel locks them)
LOCKED_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC))

# the C library this interpreter already loaded (find_library would run `ldconfig`: ~50 ms a call)
libc = ctypes.CDLL(None, use_errno=True)


def fail(step: str, code: int = 121) -> None:
    errno = ctypes.get_errno()
    sys.stderr.write(f"sandbox: {step} failed: {os.strerror(errno) if errno else 'error'}\n")
    sys.stderr.flush()
    os._exit(code)


def mount(source, target, fstype, flags, data=None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        fail(f"mount {source} -> {target}")


def bind(host: str, inside: str, writable: bool) -> None:
    """Bind `host` at `inside`; read-only unless `writable` (remounted with the host's locked flags)."""
    if os.path.isdir(host):
        os.makedirs(inside, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(inside), exist_ok=True)
        open(inside, "a").close()
    mount(host, inside, None, MS_BIND | MS_REC)
    if not writable:
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        host_flags = os.statvfs(host).f_flag
        flags |= sum(ms for st, ms in LOCKED_FLAGS if host_flags & st)
        mount(None, inside, None, flags)


def build_root(spec: dict) -> int:
    """The jail, entered; returns a descriptor of this PID namespace's /proc, which only PID 1 holds."""
    root, limits = spec["root"], spec["limits"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates back
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for host in spec["ro"]:
        bind(host, root + host, writable=False)
    for name in ("bin", "lib", "lib64", "lib32", "sbin"):  # merged-/usr links, or real dirs
        path = "/" + name
        if os.path.islink(path):
            os.symlink(os.readlink(path), os.path.join(root, name))
        elif os.path.isdir(path):
            bind(path, os.path.join(root, name), writable=False)
    for device in ("null", "zero", "urandom", "random"):
        bind("/dev/" + device, f"{root}/dev/{device}", writable=True)
    mount_disk(root, limits)
    proc = open_proc(root + PROC)
    limit_kernel_objects(proc, limits)
    os.chdir(root)
    machine = os.uname().machine
    if machine not in MACHINES:
        fail(f"pivot_root on {machine} (unknown syscall number)", 122)
    if libc.syscall(ctypes.c_long(MACHINES[machine]["pivot_root"]), b".", b".") != 0:
        fail("pivot_root")
    if libc.umount2(b".", MNT_DETACH) != 0:  # the old root, stacked under the new one
        fail("detaching the host's root")
    os.chdir("/")
    if libc.umount2(PROC.encode(), MNT_DETACH) != 0:  # our descriptor keeps it; no path leads to it
        fail("detaching PID 1's /proc")
    os.rmdir(PROC)
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)  # the skeleton itself
    os.chdir("/work")
    return proc


def mount_disk(root: str, limits: dict) -> None:
    """/work and /tmp: two directories of one tmpfs, so that all the program writes, and the
    files it is given, count against one quota of bytes and of files (inodes: +3 for the
    tmpfs's root and the two directories)."""
    disk = root + "/.disk"
    os.mkdir(disk)
    mount("tmpfs", disk, "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={limits['disk_bytes']},nr_inodes={limits['disk_files'] + 3},mode=0755")
    os.mkdir(disk + "/work")
    os.mkdir(disk + "/tmp")
    os.chmod(disk + "/tmp", 0o1777)
    bind(disk + "/work", root + "/work", writable=True)
    bind(disk + "/tmp", root + "/tmp", writable=True)
    if libc.umount2(disk.encode(), MNT_DETACH) != 0:  # the two binds keep the tmpfs
        fail("detaching the disk's staging mount")
    os.rmdir(disk)


def open_proc(path: str) -> int:
    """A /proc of this PID namespace (its processes only), for PID 1's memory readings."""
    os.mkdir(path)
    mount("proc", path, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)  # not inherited across exec


def limit_kernel_objects(proc: int, limits: dict) -> None:
    """The sysctls of this sandbox's own IPC and user namespaces (the host's are untouched):
    SysV shared memory at most the memory limit in all, a segment freed once nobody has it
    attached (so that all of it is in some process's memory, which PID 1 counts); 16 message
    queues of 16 KiB; 4096 semaphores; no nested user namespace (with one, the program would
    have the capabilities to mount a tmpfs of any size or make an IPC namespace with the host's
    defaults; without one it has none); 16 inotify instances of 4096 watches together."""
    memory = limits["memory_bytes"]
    settings = (("kernel/shmmax", memory), ("kernel/shmall", memory // os.sysconf("SC_PAGE_SIZE")),
                ("kernel/shmmni", 64), ("kernel/shm_rmid_forced", 1), ("kernel/msgmni", 16),
                ("kernel/sem", "250 4096 32 64"), ("user/max_user_namespaces", 0),
                ("user/max_inotify_instances", 16), ("user/max_inotify_watches", 4096))
    for name, value in settings:
        try:
            fd = os.open("sys/" + name, os.O_WRONLY, dir_fd=proc)
            try:
                os.write(fd, str(value).encode())
            finally:
                os.close(fd)
        except OSError as error:
            sys.stderr.write(f"sandbox: setting {name} = {value} failed: {error}\n")
            os._exit(121)


def set_limits(limits: dict) -> None:
    for name, value in (("RLIMIT_AS", limits["memory_bytes"]), ("RLIMIT_NPROC", limits["processes"]),
                        ("RLIMIT_FSIZE", limits["file_bytes"]), ("RLIMIT_NOFILE", limits["open_files"]),
                        ("RLIMIT_CORE", 0), ("RLIMIT_MEMLOCK", 0), ("RLIMIT_MSGQUEUE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))
    cpu = limits["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL a second later


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def seccomp_program(machine: str) -> list[tuple[int, int, int, int]]:
    """A classic BPF program over seccomp_data (nr at offset 0, arch at 4, argument i at 16 + 8i):
    EPERM for REFUSED_SYSCALLS, for setsockopt of a socket's buffer sizes and for fcntl
    F_SETPIPE_SZ (socket and pipe buffers then keep the kernel's default size, which PID 1
    charges per socket; see socket_charge_kb), and for any syscall of another ABI (32-bit or x32
    entry points have other numbers); everything else allowed."""
    numbers = {**MACHINES[machine], **COMMON_SYSCALLS}
    low_word = 4 if machine == "s390x" else 0  # big-endian: an argument's low 32 bits come second

    def argument(index: int) -> tuple:
        return ("load", 16 + 8 * index + low_word)

    code = [("load", 4), ("equal", numbers["audit_arch"], None, "deny"), ("load", 0)]
    if machine == "x86_64":
        code.append(("at_least", X32_SYSCALL_BIT, "deny", None))
    code += [("equal", numbers[name], "deny", None) for name in REFUSED_SYSCALLS if name in numbers]
    code += [("equal", numbers["setsockopt"], "setsockopt", None), ("equal", numbers["fcntl"], "fcntl", None),
             ("return", SECCOMP_ALLOW),
             "setsockopt", argument(1), ("equal", SOL_SOCKET, None, "allow"), argument(2),
             *(("equal", option, "deny", None) for option in SOCKET_BUFFER_OPTIONS),
             "allow", ("return", SECCOMP_ALLOW),
             "fcntl", argument(1), ("equal", F_SETPIPE_SZ, "deny", None), ("return", SECCOMP_ALLOW),
             "deny", ("return", SECCOMP_EPERM)]
    return assemble(code)


SECCOMP_ALLOW, SECCOMP_EPERM = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM


def assemble(code: list) -> list[tuple[int, int, int, int]]:
    """(code, jt, jf, k) from a list of instructions and labels (strings); a jump's target is a
    label further on, or None for the next instruction."""
    opcodes = {"load": 0x20, "equal": 0x15, "at_least": 0x35, "return": 0x06}  # BPF_LD|W|ABS, JEQ|K, JGE|K, RET|K
    labels, position = {}, 0
    for item in code:
        if isinstance(item, str):
            labels[item] = position
        else:
            position += 1
    program = []
    for item in code:
        if isinstance(item, str):
            continue
        op, k, *targets = item
        here = len(program) + 1
        jt, jf = ((labels[t] - here if t else 0) for t in (targets or (None, None)))
        program.append((opcodes[op], jt, jf, k))
    return program


def refuse_syscalls() -> None:
    program = seccomp_program(os.uname().machine)
    filters = (SockFilter * len(program))(*program)
    fprog = SockFprog(len(program), filters)
    if libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(2), ctypes.byref(fprog), 0, 0) != 0:  # SECCOMP_MODE_FILTER
        fail("installing the seccomp filter")


def last_capability() -> int:
    last = 40
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:  # read before the host's /proc is gone
            last = int(f.read())
    except OSError:
        pass
    return last


def write_maps(pid: int, outer_uid: int, outer_gid: int) -> None:
    """The user namespace's id maps, written from outside (the parent namespace). As real root
    we map 0 -> 0 (the jail is built with root's view of the host's files) and the snippet's
    SNIPPET_ID -> nobody: the kernel exempts real root from the process limit, so the snippet
    must not be root outside. Otherwise the only map an unprivileged user may write: 0 -> us."""
    if outer_uid == 0:
        uid_map = gid_map = f"0 0 1\n{SNIPPET_ID} {NOBODY} 1\n"
    else:
        with open(f"/proc/{pid}/setgroups", "w") as f:
            f.write("deny")  # required before an unprivileged gid_map
        uid_map, gid_map = f"0 {outer_uid} 1\n", f"0 {outer_gid} 1\n"
    with open(f"/proc/{pid}/uid_map", "w") as f:
        f.write(uid_map)
    with open(f"/proc/{pid}/gid_map", "w") as f:
        f.write(gid_map)


def run_snippet(spec: dict, last_cap: int, snippet_id: int) -> None:
    """PID 2: limits, no capabilities, the snippet's own id; then exec. Never returns."""
    set_limits(spec["limits"])
    bits = SECBIT_NOROOT | SECBIT_NOROOT_LOCKED  # exec as uid 0 grants no capabilities
    if libc.prctl(PR_SET_SECUREBITS, ctypes.c_ulong(bits), 0, 0, 0) != 0:
        fail("locking the secure bits")
    for cap in range(last_cap + 1):
        if libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) != 0:
            fail(f"dropping capability {cap}")
    if snippet_id:
        os.setgroups([])
        os.setgid(snippet_id)
        os.setuid(snippet_id)  # clears the permitted and effective capabilities too
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        fail("no_new_privs")
    refuse_syscalls()
    try:
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except OSError as error:
        sys.stderr.write(f"sandbox: exec {spec['argv'][0]} failed: {error}\n")
    os._exit(123)


def run_init(spec: dict, status_fd: int, go_fd: int, last_cap: int, snippet_id: int) -> None:
    """PID 1 of the new PID namespace: build the jail, start the snippet, watch, reap, report. The
    snippet is never init: the kernel treats a namespace's init specially (it ignores
    default-action signals such as the CPU limit's SIGXCPU). init's exit kills every process
    left in the namespace."""
    libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
    # Not dumpable: where the trainer is not root, the snippet has init's uid, and could
    # otherwise ptrace init (its memory watch, its report).
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    proc = build_root(spec)
    files = receive_files(go_fd)
    if files is None:  # built ahead of its call (a warm jail), or the call went away
        os._exit(0)
    write_files(files, snippet_id)
    child = os.fork()
    if child == 0:
        os.close(status_fd)  # the snippet cannot write a status of its own
        os.close(proc)
        run_snippet(spec, last_cap, snippet_id)
    report = watch(child, proc, spec["limits"]["memory_bytes"] >> 10, socket_charge_kb(proc))
    os.write(status_fd, marshal.dumps(report))
    os._exit(0)


def receive_files(go_fd: int) -> dict | None:
    """The call's go: b"g", the length of its files (8 bytes, little-endian), then the files (a
    marshalled {relative name: bytes}). None: the pipe closed without a go. A length, not the
    end of the pipe: a process the trainer forks meanwhile may hold a copy of its write end."""
    header = read_exactly(go_fd, 9)
    if len(header) < 9 or header[:1] != b"g":
        return None
    data = read_exactly(go_fd, int.from_bytes(header[1:], "little"))
    os.close(go_fd)
    return marshal.loads(data)


def read_exactly(fd: int, size: int) -> bytes:
    """`size` bytes, or fewer where the pipe ends first."""
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def write_files(files: dict, owner: int) -> None:
    """Into /work (the quota's tmpfs), all owned by the snippet's id."""
    try:
        for name, data in files.items():
            path = os.path.join("/work", name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        for directory, _, names in os.walk("/work"):
            for path in [directory, *(os.path.join(directory, name) for name in names)]:
                os.lchown(path, owner, owner)
    except OSError as error:
        sys.stderr.write(f"sandbox: writing the program's files into /work failed: {error}\n")
        os._exit(121)


def watch(child: int, proc: int, limit_kb: int, socket_kb: int) -> dict:
    """Reap every process until the snippet ends. Meanwhile, every WATCH_SECONDS or sooner
    (next_reading_in), and at once when the snippet ends (its pidfd wakes the poll), add up the
    sandbox's memory; above `limit_kb`, kill every process in the namespace. The report: how the
    snippet ended, its CPU time, the largest memory reading and whether it was over."""
    try:
        pidfd = os.pidfd_open(child)
    except OSError as error:
        sys.stderr.write(f"sandbox: pidfd_open failed (Linux 5.3 or later is needed): {error}\n")
        os._exit(121)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    peak_kb, over = 0, False
    wait, last_kb, last_at = WATCH_SECONDS, 0, time.monotonic()
    while True:
        poller.poll(wait * 1000)  # first: a program shorter than WATCH_SECONDS is read once, as it ends
        ended = reap(child)
        # Read also once the snippet has ended: the processes it left behind hold their memory
        # until init exits, and they may have gone over the limit since the last reading.
        memory_kb, now = sandbox_memory_kb(proc, socket_kb), time.monotonic()
        peak_kb = max(peak_kb, memory_kb)
        wait = next_reading_in(memory_kb - last_kb, now - last_at, limit_kb - memory_kb)
        last_kb, last_at = memory_kb, now
        if memory_kb > limit_kb and not over:
            over = True
            os.kill(-1, SIGKILL)  # every process of this PID namespace but init
        if ended is not None:
            break
    status, usage = ended
    report = {"cpu_seconds": usage.ru_utime + usage.ru_stime, "max_rss_kb": usage.ru_maxrss,
              "memory_peak_kb": peak_kb, "memory_exceeded": over}
    if os.WIFSIGNALED(status):
        report["signal"] = os.WTERMSIG(status)
    else:
        report["exit_code"] = os.WEXITSTATUS(status)
    return report


def next_reading_in(grown_kb: int, seconds: float, headroom_kb: int) -> float:
    """Seconds to the next memory reading. A program can take what it allocates in one interval
    beyond the limit before a reading ends it, and a loaded machine stretches intervals; so while
    memory grows at a rate that would pass the limit within WATCH_SECONDS, read again after half
    the time that rate leaves (at least WATCH_SECONDS_GROWING): the overshoot shrinks with the
    headroom instead of growing with the machine's speed. Steady or shrinking memory: the usual
    cadence, so a program idling near its limit costs no more than one far below it."""
    if grown_kb <= 0 or seconds <= 0:
        return WATCH_SECONDS
    time_to_limit = max(headroom_kb, 0) * seconds / grown_kb
    return min(WATCH_SECONDS, max(WATCH_SECONDS_GROWING, time_to_limit / 2))


def reap(child: int):
    """Reap every process that has ended; (status, rusage) once `child` has, else None."""
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            fail("waiting for the snippet", 124)
        if pid == child:
            return status, usage
        if pid == 0:
            return None


def sandbox_memory_kb(proc: int, socket_kb: int) -> int:
    """All the sandbox's processes together: each one's resident anonymous and shared memory
    (/proc/PID/status), the resident pages of its SysV segments, and `socket_kb` for each of its
    network namespace's sockets. Where it cannot tell it errs high: a page two processes map
    counts for each, and a SysV page once more for each process that maps it."""
    total = shm_resident_kb(proc) + sockets(proc) * socket_kb
    for name in os.listdir(proc):
        if name.isdigit() and name != "1":  # init itself is this launcher, not the program
            for line in read_proc(proc, name + "/status").splitlines():
                if line.startswith((b"RssAnon:", b"RssShmem:")):
                    total += int(line.split()[1])
    return total


def socket_charge_kb(proc: int) -> int:
    """The most one socket can hold in kernel buffers: the larger default buffer size, doubled
    (the kernel lets one message past it). Unread unix-socket data is charged to its sender,
    which stays counted until the data is read or freed; netlink replies, to the receiver's
    receive buffer. The seccomp filter keeps the program from raising either size."""
    return 2 * max(int(read_proc(proc, f"sys/net/core/{kind}_default")) for kind in ("wmem", "rmem")) >> 10


def sockets(proc: int) -> int:
    """Sockets of this network namespace: every one the program made, also those only in flight
    (sent over another socket) or closed with data still unread."""
    first = read_proc(proc, "net/sockstat").split(b"\n", 1)[0]  # b"sockets: used N"
    return int(first.split()[-1]) if first.startswith(b"sockets: used") else 0


def shm_resident_kb(proc: int) -> int:
    lines = read_proc(proc, "sysvipc/shm").splitlines()
    if not lines:
        return 0
    column = lines[0].split().index(b"rss")
    return sum(int(line.split()[column]) for line in lines[1:] if line.strip()) >> 10


def read_proc(proc: int, path: str) -> bytes:
    """A /proc file's text, or b"" for a process that has gone meanwhile."""
    try:
        fd = os.open(path, os.O_RDONLY, dir_fd=proc)
    except OSError:
        return b""
    try:
        return os.read(fd, 1 << 16)
    except OSError:
        return b""
    finally:
        os.close(fd)


def main() -> None:
    spec, status_fd, go_fd = marshal.loads(bytes.fromhex(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3])
    last_cap = last_capability()
    outer_uid, outer_gid = os.geteuid(), os.getegid()
    snippet_id = SNIPPET_ID if outer_uid == 0 else 0
    unshared_r, unshared_w = os.pipe()
    mapped_r, mapped_w = os.pipe()
    child = os.fork()
    if child == 0:
        libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
        if libc.unshare(NAMESPACES) != 0:
            fail("creating the namespaces (unshare)", 125)
        os.write(unshared_w, b"u")
        if os.read(mapped_r, 1) != b"m":  # the parent writes our id maps
            fail("waiting for the id maps", 126)
        init = os.fork()  # the first process in the new PID namespace: its PID 1
        if init == 0:
            run_init(spec, status_fd, go_fd, last_cap, snippet_id)
        _, status = os.waitpid(init, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    os.close(status_fd)
    os.close(go_fd)
    if os.read(unshared_r, 1) == b"u":
        try:
            write_maps(child, outer_uid, outer_gid)
        except OSError as error:
            sys.stderr.write(f"sandbox: writing the id maps failed: {error}\n")
            os.kill(child, SIGKILL)
            os._exit(127)
        os.write(mapped_w, b"m")
    _, status = os.waitpid(child, 0)
    # The mount point goes with the jail, here, whoever owned it: an owner that died without
    # closing its sandbox (a reward worker ends with os._exit) must not leave it behind.
    try:
        os.rmdir(spec["root"])  # only a mount point out here: the tmpfs lived in the namespace
    except OSError:
        pass
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


if __name__ == "__main__":
    main()
