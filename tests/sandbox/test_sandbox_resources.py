"""Memory and disk a sandboxed program could take from the host without counting against its
limits, each tried for real (no mocks): the program tries to hold several times its limit and
prints how much it got, measured by the kernel where it can be (SHM_INFO, st_blocks); the call
ends with its named status and what it held stays within the limit.

Before the fix (issue 43): the address-space limit was per process and covered nothing else, so
forked children, SysV shared memory, memfd files, socket buffers and a nested tmpfs each held
several times `memory_mb`, and `/work` was the host's temporary directory with a per-file cap
only."""

from __future__ import annotations

import pytest

from megatron_rl.sandbox import Sandbox, SandboxLimits

MB = 1 << 20
# A wall limit well above what any case needs: each must end at the limit it tests, also when it
# gets a fraction of a core (the suite's other worker; at 8 s one ended by the clock there).
LIMITS = SandboxLimits(wall_seconds=40, cpu_seconds=4, memory_mb=128, processes=16, output_bytes=8192, file_mb=4,
                       disk_mb=16, disk_files=200)
# The memory of all processes together is read every 10 ms, sooner while it grows toward the
# limit; a program can fault in this much more before the next reading ends it.
OVERSHOOT_MB = 48


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(LIMITS)


def printed(result, key: str) -> list[int]:
    """The numbers the program printed after `key` (one per line), in order."""
    return [int(line.split()[1]) for line in result.stdout.splitlines() if line.startswith(key + " ")]


FORKED_CHILDREN = """
import os, time
done = os.pipe()
for _ in range(6):  # six children of 80 MB each: every one within the address-space limit
    if os.fork() == 0:
        held = []
        for _ in range(10):
            held.append(b'x' * (8 << 20))  # written, so resident
            os.write(done[1], b'8')
            time.sleep(0.005)  # a reading falls between two chunks even on a loaded machine
        os.write(done[1], b'd')
        time.sleep(30)
os.close(done[1])
total = finished = 0
while finished < 6:
    data = os.read(done[0], 64)
    total += 8 * data.count(b'8')
    finished += data.count(b'd')
    print('held', total, flush=True)
print('all children hold their memory', flush=True)
"""


def test_memory_of_all_its_processes_together_is_capped(sandbox):
    result = sandbox.run_python(FORKED_CHILDREN)
    held = printed(result, "held")
    assert result.status == "memory_limit", (result.status, held[-1:], result.stderr[-500:])
    assert "all children" not in result.stdout
    assert max(held, default=0) <= LIMITS.memory_mb + OVERSHOOT_MB, held[-1]  # before: 480 MB held
    assert result.memory_mb is not None and result.memory_mb > LIMITS.memory_mb
    assert sandbox.run_python("x = b'x' * (64 << 20)\nprint(len(x) >> 20)").stdout == "64\n"  # within: fine


def test_memory_is_read_sooner_while_it_grows_toward_the_limit():
    """The watcher's cadence (launcher.next_reading_in): what a program takes beyond the limit is
    what it allocates between two readings, so while memory grows fast enough to pass the limit
    before the next usual reading, the next comes after half the time left (at least 1 ms).
    Measured on the sandbox (4 MB every 0.5 ms from four processes, 15 runs each): the last
    reading before the kill 9.1 MB over the limit (median; worst 22.3) at a fixed 10 ms, 2.6
    (worst 12.9) with this cadence."""
    from megatron_rl.sandbox.launcher import WATCH_SECONDS, WATCH_SECONDS_GROWING, next_reading_in

    assert WATCH_SECONDS_GROWING < WATCH_SECONDS
    assert next_reading_in(0, WATCH_SECONDS, 1000) == WATCH_SECONDS  # steady: the usual cadence
    assert next_reading_in(-5000, WATCH_SECONDS, 1000) == WATCH_SECONDS  # shrinking
    assert next_reading_in(100, WATCH_SECONDS, 100_000) == WATCH_SECONDS  # slow growth, far below
    # 8 MB in 10 ms with 24 MB left: the limit is 30 ms away, beyond the next usual reading
    assert next_reading_in(8 << 10, 0.010, 24 << 10) == WATCH_SECONDS
    # 8 MB in 10 ms with 8 MB left: 10 ms away, so read in 5 ms; with 2 MB left, in 1.25 ms
    assert next_reading_in(8 << 10, 0.010, 8 << 10) == pytest.approx(0.005)
    assert next_reading_in(8 << 10, 0.010, 2 << 10) == pytest.approx(0.00125)
    # never sooner than the floor, also at or past the limit
    assert next_reading_in(8 << 10, 0.010, 100) == WATCH_SECONDS_GROWING
    assert next_reading_in(8 << 10, 0.010, -100) == WATCH_SECONDS_GROWING
    assert next_reading_in(8 << 10, 0.0, 100) == WATCH_SECONDS  # no time between readings: no rate


SYSV_SEGMENTS = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
libc.shmdt.argtypes = (ctypes.c_void_p,)
class ShmInfo(ctypes.Structure):
    _fields_ = [('used_ids', ctypes.c_int), ('shm_tot', ctypes.c_ulong), ('shm_rss', ctypes.c_ulong),
                ('shm_swp', ctypes.c_ulong), ('swap_attempts', ctypes.c_ulong), ('swap_successes', ctypes.c_ulong)]
IPC_CREAT, SHM_INFO = 0o1000, 14
print('huge', libc.shmget(0, 1 << 30, IPC_CREAT | 0o600), ctypes.get_errno())
for _ in range(8):  # 8 x 32 MB, each written through a mapping that is then dropped
    segment = libc.shmget(0, 32 << 20, IPC_CREAT | 0o600)
    if segment < 0:
        print('refused', ctypes.get_errno())
        break
    address = libc.shmat(segment, None, 0)
    ctypes.memset(address, 1, 32 << 20)
    libc.shmdt(address)
info = ShmInfo()
libc.shmctl(0, SHM_INFO, ctypes.byref(info))
print('resident', info.shm_rss * 4096 >> 20)
print('segments', info.used_ids)
"""


def test_sysv_shared_memory_counts_against_the_limit(sandbox):
    result = sandbox.run_python(SYSV_SEGMENTS)
    assert result.ok, result
    assert printed(result, "huge") == [-1]  # a segment above the limit: EINVAL
    resident = printed(result, "resident")
    assert resident and resident[0] <= LIMITS.memory_mb, result.stdout  # before: 256 MB held, no process mapping it


MEMORY_OUTSIDE_THE_ADDRESS_SPACE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
files = []
try:
    for _ in range(48):  # 48 x 4 MB files in memory, none mapped
        fd = os.memfd_create('x')
        os.write(fd, b'x' * (4 << 20))
        files.append(fd)
except OSError as error:
    print('memfd_refused', error.errno)
print('memfd', sum(os.fstat(fd).st_blocks for fd in files) * 512 >> 20)
params = (ctypes.c_char * 120)()  # struct io_uring_params
print('io_uring', libc.syscall(425, 4096, params), ctypes.get_errno())
# a nested user and mount namespace would allow a tmpfs of any size
print('nested', libc.unshare(0x10000000 | 0x00020000), ctypes.get_errno())
print('mount', libc.mount(b'none', b'/work', b'tmpfs', 0, b'size=100g'), ctypes.get_errno())
"""


def test_memory_files_io_rings_and_nested_mounts_are_refused(sandbox):
    result = sandbox.run_python(MEMORY_OUTSIDE_THE_ADDRESS_SPACE)
    assert result.ok, result
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines.get("memfd_refused") == "1" and lines["memfd"] == "0", result.stdout  # EPERM; before: 192 MB
    assert lines["io_uring"] == "-1 1", result.stdout
    assert lines["nested"] == "-1 28", result.stdout  # ENOSPC: no user namespace may be made inside
    assert lines["mount"].startswith("-1 "), result.stdout


SOCKET_BUFFERS = """
import os, socket
probe = socket.socket(socket.AF_UNIX)
try:
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)
except OSError as error:
    print('sndbuf_refused', error.errno, flush=True)
done = os.pipe()
for _ in range(6):  # six children, each filling the buffers of 28 socket pairs (2 MB a socket at most)
    if os.fork() == 0:
        pairs = [socket.socketpair() for _ in range(28)]
        for end in (end for pair in pairs for end in pair):
            end.setblocking(False)
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                try:
                    end.setsockopt(socket.SOL_SOCKET, option, 1 << 30)
                except OSError:
                    pass
            queued = 0
            try:
                while queued < 2 << 20:
                    queued += end.send(b'x' * 65536)
            except BlockingIOError:
                pass
            os.write(done[1], b'%d ' % queued)
        os.write(done[1], b'd ')
        import time; time.sleep(30)
os.close(done[1])
total = finished = 0
while finished < 6:
    for word in os.read(done[0], 4096).split():
        if word == b'd':
            finished += 1
        else:
            total += int(word)
    print('queued', total >> 20, flush=True)
print('all queued', flush=True)
"""


def test_socket_buffers_count_against_the_limit(sandbox):
    result = sandbox.run_python(SOCKET_BUFFERS)
    assert printed(result, "sndbuf_refused") == [1], result.stdout[:200]  # refused: EPERM
    queued = printed(result, "queued")
    # Ended by the memory limit (the sockets' charge), with at most the limit's worth queued. Whether
    # the children had finished queueing before the 10 ms reading that ends them depends on the
    # machine's load (the suite's other worker): it is not asserted.
    assert result.status == "memory_limit", (result.status, queued[-1:])
    assert max(queued, default=0) <= LIMITS.memory_mb, queued[-1]  # before: 672 MB in kernel buffers


SOCKETS_LEFT_BEHIND = """
import os, socket, time
done = os.pipe()
for _ in range(6):  # six children of 28 socket pairs each: 336 sockets, charged 2 x 208 KiB each
    if os.fork() == 0:
        pairs = [socket.socketpair() for _ in range(28)]
        os.write(done[1], b'd')
        time.sleep(30)
os.close(done[1])
finished = 0
while finished < 6:
    finished += len(os.read(done[0], 16))
os._exit(0)  # at once: the children's sockets exist for a few ms before, a reading comes every 10 ms
"""


def test_what_a_program_leaves_behind_when_it_ends_is_counted(sandbox):
    """The program's main process ends the moment its children went over the limit: the reading
    taken as it ends counts them. Before, only the 10 ms readings could, and they missed it in 24
    of 30 runs (status ok); five runs here, so that a missing final reading fails the test."""
    for _ in range(5):
        result = sandbox.run_python(SOCKETS_LEFT_BEHIND)
        assert result.status == "memory_limit", result
        assert result.memory_mb > LIMITS.memory_mb, result


FILL_THE_DISK = """
with open('/tmp/first', 'wb') as f:  # /tmp and /work share the quota
    f.write(b'x' * (3 << 20))
written = 3
try:
    for i in range(100):  # then 100 files of 4 MB (the per-file limit) in /work
        with open(f'f{i}', 'wb') as f:
            f.write(b'x' * (4 << 20))
        written += 4
finally:
    print('written', written, flush=True)
"""

MANY_FILES = """
import os
made = 0
try:
    for i in range(100000):
        os.mkdir(f'd{i}') if i % 2 else open(f'e{i}', 'wb').close()
        made += 1
finally:
    print('made', made, flush=True)
"""


def test_the_work_directory_and_tmp_share_one_disk_quota(sandbox):
    result = sandbox.run_python(FILL_THE_DISK)
    assert result.status == "disk_limit" and "No space left on device" in result.stderr, result
    assert printed(result, "written")[0] <= LIMITS.disk_mb, result.stdout  # before: 403 MB
    result = sandbox.run_python(MANY_FILES)
    assert result.status == "disk_limit", result
    assert printed(result, "made")[0] <= LIMITS.disk_files, result.stdout  # before: a timeout
    assert sandbox.run_python("open('f', 'wb').write(b'x' * (4 << 20))\nprint('ok')").stdout == "ok\n"  # emptied


def test_the_given_files_are_written_into_the_quota(sandbox):
    result = sandbox.run_python("import os\nprint(sorted(os.listdir('.')), open('sub/data.txt').read())",
                                files={"sub/data.txt": "given"})
    assert result.ok and result.stdout == "['main.py', 'sub'] given\n", result
    with pytest.raises(ValueError, match="outside the work directory"):
        sandbox.run_python("pass", files={"../escape.txt": "x"})
    with pytest.raises(ValueError, match="more than SandboxLimits.disk_mb"):
        sandbox.run_python("pass", files={"big.txt": "x" * (LIMITS.disk_mb * MB + 1)})


def test_disk_limits_are_checked():
    with pytest.raises(ValueError, match="disk_mb must be a number > 0"):
        SandboxLimits(disk_mb=0)
    with pytest.raises(ValueError, match="disk_files must be a number > 0"):
        SandboxLimits(disk_files=0)
