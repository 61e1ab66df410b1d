"""The sandbox against hostile snippets, with the real namespaces and limits (no mocks): each one
is contained, reported by its status, leaves nothing behind, and the next call runs normally.

Network tests only ever address 127.0.0.1 (a listener this test opens), never anything else."""

from __future__ import annotations

import dataclasses
import glob
import os
import socket
import subprocess
import sys
import tempfile
import threading

import pytest

from _support.processes import REPO
from megatron_rl.sandbox import Sandbox, SandboxLimits

# The wall limit is far above the CPU limit: a busy loop must meet its CPU limit first even when
# it gets a fraction of a core (the suite's other worker, a loaded CI host; at 4 s it met the wall
# limit there). The wall limit itself is tested with its own short one.
LIMITS = SandboxLimits(wall_seconds=30, cpu_seconds=2, memory_mb=256, processes=16, output_bytes=4096, file_mb=4)
SHORT_WALL = dataclasses.replace(LIMITS, wall_seconds=4)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(LIMITS)


def sandboxes_alive() -> list[str]:
    """Processes still running a sandboxed snippet (their command line names /work/main.py)."""
    found = subprocess.run(["pgrep", "-af", "/work/main.py"], capture_output=True, text=True).stdout
    return [line for line in found.splitlines() if "pgrep" not in line]


def work_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "sandbox-*")))


def still_works(sandbox: Sandbox) -> None:
    result = sandbox.run_python("print(6 * 7)")
    assert result.ok and result.stdout == "42\n", result


def test_a_snippet_runs_in_an_empty_directory_with_a_clean_environment(sandbox, monkeypatch):
    before = work_dirs()
    monkeypatch.setenv("MEGATRON_RL_TEST_SECRET", "s3cret")
    result = sandbox.run_python(
        "import os, sys\n"
        "print(os.getcwd(), sorted(os.listdir('.')), sorted(os.environ), sys.stdin.read(), open('data.txt').read())",
        stdin="from stdin", files={"data.txt": "given"})
    assert result.ok, result
    assert result.stdout.split(" ", 2)[:2] == ["/work", "['data.txt',"]
    assert "['HOME', 'LANG', 'PATH', 'PYTHONDONTWRITEBYTECODE', 'TMPDIR']" in result.stdout
    assert "from stdin given" in result.stdout
    assert "s3cret" not in result.stdout
    assert work_dirs() == before  # its directory (and the new root's mount point) removed afterwards


def test_infinite_loop_stops_at_the_cpu_limit(sandbox):
    result = sandbox.run_python("while True: pass")
    assert result.status == "cpu_limit" and result.cpu_seconds >= LIMITS.cpu_seconds - 0.2, result
    assert result.wall_seconds < LIMITS.wall_seconds
    still_works(sandbox)


def test_sleeping_forever_stops_at_the_wall_limit():
    result = Sandbox(SHORT_WALL).run_python("import time\ntime.sleep(1000)")
    assert result.status == "timeout", result
    assert SHORT_WALL.wall_seconds <= result.wall_seconds < SHORT_WALL.wall_seconds + 2
    assert not sandboxes_alive()


def test_fork_bomb_is_capped_and_leaves_no_process(sandbox):
    result = sandbox.run_python(
        "import os, time\n"
        "made = refused = 0\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(1000)\n"
        "        made += 1\n"
        "    except OSError:\n"
        "        refused += 1\n"
        "print(made, refused, flush=True)\n"
        "while True:\n"  # and then the classic: every process forks forever
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        pass\n")
    assert result.status in ("timeout", "cpu_limit"), result
    made, refused = map(int, result.stdout.split())
    assert made < LIMITS.processes and made + refused == 200, result.stdout  # the process limit refused the rest
    assert not sandboxes_alive()  # every forked child died with the sandbox's PID namespace
    still_works(sandbox)


def test_ten_gigabyte_allocation_fails_inside(sandbox):
    result = sandbox.run_python("x = bytearray(10 * 1024**3)\nprint('allocated')")
    assert result.status == "memory_limit" and "MemoryError" in result.stderr, result
    assert "allocated" not in result.stdout


def test_a_gigabyte_of_output_is_cut_at_the_cap(sandbox):
    result = sandbox.run_python("import sys\nfor _ in range(16384):\n    sys.stdout.write('x' * 65536)\n")
    assert result.status == "output_limit", result
    assert len(result.stdout) == LIMITS.output_bytes
    assert result.wall_seconds < LIMITS.wall_seconds  # ended at the cap, not by the clock
    still_works(sandbox)


def test_writes_outside_its_directory_fail_and_the_host_is_untouched(sandbox, tmp_path):
    target = tmp_path / "written-by-the-sandbox"
    probe = (f"import os\nfor path in ({str(target)!r}, '/usr/evil', '/etc/evil', '/evil', '/tmp/../usr/lib/evil'):\n"
             "    try:\n        open(path, 'w').write('x')\n        print('WROTE', path)\n"
             "    except OSError as e:\n        print('refused', path, e.errno)\n")
    result = sandbox.run_python(probe)
    assert result.ok and "WROTE" not in result.stdout, result.stdout
    assert result.stdout.count("refused") == 5
    assert not target.exists() and not os.path.exists("/usr/evil") and not os.path.exists("/etc/evil")
    big = sandbox.run_python(f"open('big', 'wb').write(b'x' * ({LIMITS.file_mb} << 21))")
    assert big.status == "error" and "File too large" in big.stderr, big


def test_a_file_placed_outside_its_directory_cannot_be_read(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the test's secret")
    here = os.path.abspath(__file__)
    result = sandbox.run_python(
        f"for path in ({str(secret)!r}, {here!r}, '/etc/passwd', '/proc/1/environ', '/root/.bashrc'):\n"
        "    try:\n        print('READ', path, open(path).read()[:40])\n"
        "    except OSError as e:\n        print('refused', path, e.errno)\n")
    assert result.ok and "READ" not in result.stdout and "secret" not in result.stdout.replace("secret.txt", ""), \
        result.stdout
    assert result.stdout.count("refused") == 5


def test_the_parents_environment_is_out_of_reach(sandbox, monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_TEST_SECRET", "s3cret-env")
    result = sandbox.run_python(
        "import os\nfound = [v for v in os.environ.values() if 's3cret' in v]\n"
        "for path in ('/proc/self/environ', '/proc/1/environ', f'/proc/{os.getppid()}/environ'):\n"
        "    try:\n        found.append(open(path, 'rb').read().decode())\n"
        "    except OSError:\n        pass\n"
        "print(os.getppid(), [f for f in found if 's3cret' in f])\n")
    assert result.ok and result.stdout.strip() == "1 []", result  # its parent is the jail's PID 1


def test_no_connection_reaches_a_listener_on_127_0_0_1(sandbox):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(3)
    port = listener.getsockname()[1]
    accepted = []

    def accept():
        try:
            accepted.append(listener.accept())
        except OSError:
            pass

    waiter = threading.Thread(target=accept)
    waiter.start()
    result = sandbox.run_python(
        "import socket, os\n"
        f"for family, address in ((socket.AF_INET, ('127.0.0.1', {port})), (socket.AF_INET6, ('::1', {port}))):\n"
        "    s = socket.socket(family)\n    s.settimeout(2)\n"
        "    try:\n        s.connect(address)\n        print('CONNECTED', address)\n"
        "    except OSError as e:\n        print('refused', e.errno)\n"
        f"print('system', os.system('exec 3<>/dev/tcp/127.0.0.1/{port} 2>/dev/null || exit 7') >> 8)\n")
    waiter.join()
    listener.close()
    assert not accepted, "a sandboxed snippet connected to the host's loopback"
    assert result.ok and "CONNECTED" not in result.stdout and result.stdout.count("refused") == 2, result.stdout
    assert "system 0" not in result.stdout, result.stdout


def test_os_system_subprocess_and_ctypes_escapes_stay_inside(sandbox):
    result = sandbox.run_python(
        "import ctypes, os, subprocess\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "MS_REMOUNT, MS_BIND = 32, 4096\n"
        "print('remount', libc.mount(None, b'/usr', None, MS_REMOUNT | MS_BIND, None), ctypes.get_errno())\n"
        "print('chroot', libc.chroot(b'/work'), ctypes.get_errno())\n"
        "print('system', os.system('touch /usr/escaped 2>/dev/null') >> 8)\n"
        "print('subprocess', subprocess.run(['sh', '-c', 'echo $MEGATRON_RL_TEST_SECRET; id -u; ls /']).returncode)\n"
        # a nested user namespace grants capabilities, but only over copies of the mounts whose
        # read-only flag the kernel locked
        "print('nested', libc.unshare(0x10000000 | 0x00020000), ctypes.get_errno())\n"
        "print('remount2', libc.mount(None, b'/usr', None, MS_REMOUNT | MS_BIND, None), ctypes.get_errno())\n"
        "try:\n    open('/usr/escaped', 'w')\n    print('ESCAPED')\nexcept OSError as e:\n    print('refused', e.errno)\n")
    assert result.ok, result
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    assert lines["remount"] == "-1 1" and lines["chroot"] == "-1 1"  # EPERM: no capabilities
    assert lines["system"] != "0" and lines["remount2"].startswith("-1") and "ESCAPED" not in result.stdout
    assert not os.path.exists("/usr/escaped")


REFUSING_MACHINE = """
import sys
from megatron_rl.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
limits = SandboxLimits(wall_seconds=30, cpu_seconds=2, memory_mb=256, output_bytes=4096)
try:
    Sandbox(limits)
    print("NOT REFUSED")
except SandboxUnavailable as error:
    print("refused:", error)
box = Sandbox(limits, isolation="none")
print("loop", box.run_python("while True: pass").status)
print("alloc", box.run_python("x = bytearray(10 * 1024**3)").status)
flood = box.run_python("import sys\\nwhile True: sys.stdout.write('x' * 65536)")
print("flood", flood.status, len(flood.stdout))
print("env", box.run_python("import os; print(sorted(os.environ))").stdout.strip())
from megatron_rl.config import load_config
from megatron_rl.errors import ConfigError
from megatron_rl.rewards import resolve_reward
from megatron_rl.train.preflight import check_agents
for what, start in (("tool", lambda: check_agents(load_config(None, ["rollout.tools=[python]",
                                                                      "data.prompt_format=chat"]))),
                    ("reward", lambda: resolve_reward("code_tests"))):
    try:
        start()
        print(what, "NOT REFUSED")
    except ConfigError as error:
        print(what, "refused:", error)
print("opt-out reward", resolve_reward("code_tests", {"isolation": "none"}).name)
"""


def test_a_machine_without_user_namespaces_refuses_unless_opted_out_and_the_opt_out_keeps_the_limits():
    """The refusing machine is real: a user namespace whose user.max_user_namespaces is 0 (so
    the kernel refuses the sandbox's namespaces with ENOSPC), made with util-linux `unshare`.
    There, Sandbox() refuses, the opt-out keeps its limits, and a run configured with the
    `python` tool or the `code_tests` reward stops at start-up with the reason."""
    command = ["unshare", "--user", "--map-root-user", "sh", "-c",
               'echo 0 > /proc/sys/user/max_user_namespaces && exec "$0" -c "$1"', sys.executable, REFUSING_MACHINE]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("refused: cannot sandbox model-written code on this machine: the kernel refused"), lines
    assert "No space left on device" in lines[0] and "isolation 'none'" in lines[0] and "network" in lines[0]
    assert lines[1:5] == ["loop cpu_limit", "alloc memory_limit", f"flood output_limit {LIMITS.output_bytes}",
                          "env ['HOME', 'LANG', 'PATH', 'PYTHONDONTWRITEBYTECODE', 'TMPDIR']"], lines
    # a run that would use the sandbox stops at start-up, saying why and what to do
    assert lines[5].startswith("tool refused: rollout.tools: the built-in 'python' tool") and "namespaces" in lines[5]
    assert lines[6].startswith("reward refused: reward 'code_tests' runs model-written code in a sandbox") \
        and "isolation: none" in lines[6], lines[6]
    assert lines[7] == "opt-out reward code_tests"


def launchers_alive(under: str = "") -> list[str]:
    """Launcher processes (a jail's three), those whose jail root lies under `under` if given: the
    root is in the launcher's command line (its hex-encoded spec), and each keeps it, so one that
    escaped its parent still counts."""
    found = subprocess.run(["pgrep", "-af", "sandbox/launcher.py"], capture_output=True, text=True).stdout
    return [line for line in found.splitlines() if "pgrep" not in line and under.encode().hex() in line]


def test_warm_jails_contain_the_same_and_close_without_leftovers(tmp_path, monkeypatch):
    """Jails built ahead of their calls (the files are written after the build) behave as cold
    ones; closing the sandbox ends the idle ones and removes their directories. The jails' roots go
    to a folder of this test's own, by which its launchers and directories are told from those of
    sandboxes the suite's other worker runs meanwhile (a code reward's, a training run's): counting
    every launcher on the machine failed when one of those started during this test."""
    own = tmp_path / "jails"
    own.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(own))
    assert not launchers_alive(str(own))
    with Sandbox(LIMITS, warm=2) as warm:
        assert len(launchers_alive(str(own))) >= 2
        for _ in range(4):  # more calls than warm jails: the refill keeps up or a cold one is built
            result = warm.run_python("import os\nprint(open('data.txt').read(), sorted(os.environ)[0], os.getppid())",
                                     files={"data.txt": "written late"})
            assert result.ok and result.stdout == "written late HOME 1\n", result
        assert warm.run_python("while True: pass").status == "cpu_limit"
        escape = warm.run_python(f"open({str(tmp_path / 'x')!r}, 'w')")
        assert escape.status == "error" and "No such file" in escape.stderr
        assert warm.counts == {"ok": 4, "cpu_limit": 1, "error": 1}
    # No launcher of its jails is left, so no program either: a jail's programs run in its PID
    # namespace, whose processes the kernel kills when the launcher that is its PID 1 ends.
    assert not launchers_alive(str(own))
    assert not os.listdir(own)  # every jail's directories removed
    with pytest.raises(RuntimeError, match="closed"):
        warm.run_python("print(1)")


def test_limits_are_checked():
    with pytest.raises(ValueError, match="wall_seconds must be a number > 0"):
        SandboxLimits(wall_seconds=0)
    with pytest.raises(ValueError, match="processes must be >= 2"):
        SandboxLimits(processes=1)
    with pytest.raises(ValueError, match="isolation must be"):
        Sandbox(LIMITS, isolation="off")
    with pytest.raises(ValueError, match="warm must be an integer >= 0"):
        Sandbox(LIMITS, warm=-1)
