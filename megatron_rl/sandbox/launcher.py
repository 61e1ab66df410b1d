"""The sandbox's inside half, started by sandbox/runner.py once per call:
`python -I -S launcher.py SPEC STATUS_FD GO_FD`, under the base interpreter, standard library only (it
imports nothing of the project and nothing from site-packages, and nothing slow: it starts once
per call). SPEC is a hex-encoded marshal of {"work": dir,
"root": an empty dir to build the new root on, "ro": [host dirs shown read-only], "argv": [...],
"env": {...}, "limits": {...}}.

Three processes, and why (we may run as real root, and then uid 0 inside maps to uid 0 outside:
ownership alone protects nothing):
- this one stays outside and writes the id maps of the new user namespace (only a process in
  the parent namespace may map more than its own id). As real root, uid/gid 0 -> 0 (the jail is
  built with root's view of the host's files) and SNIPPET_ID -> nobody, which the snippet runs
  as: the kernel exempts real root from the process limit. As anyone else: 0 -> that user.
- its child unshares the user, mount, PID, network, IPC and UTS namespaces;
- the child's child is PID 1 of the new PID namespace. It builds the jail: a tmpfs becomes the
  new root, holding read-only binds of /usr and the interpreter's directories, a writable bind
  of the work directory, a small /tmp and /dev/{null,zero,urandom,random}; pivot_root and
  detaching the old root leave no path to the host's files in this mount namespace at all (a
  chroot alone can be escaped by anyone holding CAP_SYS_CHROOT, which a nested user namespace
  grants). The network namespace has a loopback that is down: nothing is reachable. Then it
  waits for one byte on GO_FD (a jail can be built ahead of its call; EOF: exit unused) and
  hands the work directory, written meanwhile, to the snippet's id.
- the snippet is PID 2: resource limits (address space, CPU seconds, processes, file size, open
  files; the process count is per user namespace, so it counts this sandbox only), every
  capability dropped (bounding set emptied, SECBIT_NOROOT locked, then the snippet's own uid,
  no_new_privs), so nothing can remount a read-only bind writable (a nested user namespace gives
  capabilities over copies of these mounts only, whose read-only flag the kernel locks); then
  exec with the given environment only. PID 1 reaps every orphan until the snippet ends, writes
  how it ended (a marshalled dict) to the status pipe (the snippet's copy is closed), and exits,
  which kills every process left in the namespace.

No status written (exit 121-127, a line on stderr): the jail could not be built; the runner
reports it as a sandbox failure, never as the snippet's."""

import ctypes
import marshal
import os
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
SIGKILL = 9  # (the signal module imports enum: ~10 ms of start-up)
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 24, 28, 38
SECBIT_NOROOT, SECBIT_NOROOT_LOCKED = 1, 2
# user, mount, PID, network, IPC and UTS namespaces
NAMESPACES = 0x10000000 | 0x00020000 | 0x20000000 | 0x40000000 | 0x08000000 | 0x04000000
SNIPPET_ID, NOBODY = 1, 65534  # as real root: the snippet's uid/gid inside, and what it is outside
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}
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


def build_root(spec: dict) -> None:
    root = spec["root"]
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
    os.makedirs(root + "/tmp")
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['limits']['tmp_bytes']},mode=1777")
    bind(spec["work"], root + "/work", writable=True)
    os.chdir(root)
    machine = os.uname().machine
    number = PIVOT_ROOT.get(machine)
    if number is None:
        fail(f"pivot_root on {machine} (unknown syscall number)", 122)
    if libc.syscall(ctypes.c_long(number), b".", b".") != 0:
        fail("pivot_root")
    if libc.umount2(b".", MNT_DETACH) != 0:  # the old root, stacked under the new one
        fail("detaching the host's root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)  # the skeleton itself
    os.chdir("/work")


def set_limits(limits: dict) -> None:
    for name, value in (("RLIMIT_AS", limits["memory_bytes"]), ("RLIMIT_NPROC", limits["processes"]),
                        ("RLIMIT_FSIZE", limits["file_bytes"]), ("RLIMIT_NOFILE", limits["open_files"]),
                        ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))
    cpu = limits["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL a second later


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
    try:
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except OSError as error:
        sys.stderr.write(f"sandbox: exec {spec['argv'][0]} failed: {error}\n")
    os._exit(123)


def run_init(spec: dict, status_fd: int, go_fd: int, last_cap: int, snippet_id: int) -> None:
    """PID 1 of the new PID namespace: build the jail, start the snippet, reap, report. The
    snippet is never init: the kernel treats a namespace's init specially (it ignores
    default-action signals such as the CPU limit's SIGXCPU). init's exit kills every process
    left in the namespace."""
    libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
    build_root(spec)
    if os.read(go_fd, 1) != b"g":  # built ahead of its call (a warm jail), or the call went away
        os._exit(0)
    os.close(go_fd)
    for directory, _, names in os.walk("/work"):  # the snippet's own, written after the jail was built
        for path in [directory, *(os.path.join(directory, name) for name in names)]:
            os.lchown(path, snippet_id, snippet_id)
    child = os.fork()
    if child == 0:
        os.close(status_fd)  # the snippet cannot write a status of its own
        run_snippet(spec, last_cap, snippet_id)
    while True:
        try:
            pid, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            fail("waiting for the snippet", 124)
        if pid == child:
            break
    report = {"cpu_seconds": usage.ru_utime + usage.ru_stime, "max_rss_kb": usage.ru_maxrss}
    if os.WIFSIGNALED(status):
        report["signal"] = os.WTERMSIG(status)
    else:
        report["exit_code"] = os.WEXITSTATUS(status)
    os.write(status_fd, marshal.dumps(report))
    os._exit(0)


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
    # The directories go with the jail, here, whoever owned it: an owner that died without
    # closing its sandbox (a reward worker ends with os._exit) must not leave them behind.
    remove_tree(spec["work"])
    try:
        os.rmdir(spec["root"])  # only a mount point out here: the tmpfs lived in the namespace
    except OSError:
        pass
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def remove_tree(path: str) -> None:
    """shutil.rmtree without importing shutil (start-up time): errors are ignored, as the
    runner removes whatever is left."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            remove_tree(entry.path)
        else:
            try:
                os.unlink(entry.path)
            except OSError:
                pass
    try:
        os.rmdir(path)
    except OSError:
        pass


if __name__ == "__main__":
    main()
