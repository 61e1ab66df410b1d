"""Nothing the pre-imported server (tests/_support/zygote.py) starts outlives its owner, the pytest
worker: not the server, not a run forked from it, not what the run started in a session of its own
(as a trainer starts its vLLM server), not the run's own forked child (children=True) nor the client
standing for it. Seen before: idle forks of a vLLM server (0.5-1.6 GB each) long after pytest, once
the worker's exit had killed the server with SIGKILL; and an idle server for good where the worker
died while the server imported.

Each case starts a server the way the suite does (processes.py), with a module or two to preload
instead of torch and the rest (seconds, not a minute), in a throwaway owner process."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from _support.processes import REPO, child_env

pytestmark = pytest.mark.subprocess

# A run that starts a child in a session of its own and a Python child (with children=True: forked
# from the server too, through a client of its own), prints the pids, then waits.
RUN = """
import json, os, subprocess, sys, time
alone = subprocess.Popen(["sleep", "60"], start_new_session=True)
forked = subprocess.Popen([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"],
                          stdout=subprocess.PIPE, start_new_session=True)
print(json.dumps({"run": os.getpid(), "alone": alone.pid, "client": forked.pid,
                  "forked": int(forked.stdout.readline())}), flush=True)
time.sleep(60)
"""

# The owner: the worker's part (processes.py), its server's pid first; with a run unless it is to
# be killed while its server imports; it exits, atexit and all, when its stdin closes.
OWNER = """
import json, os, subprocess, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
from _support import processes

preload, run = sys.argv[2].split(","), sys.argv[3]
processes._zygote = processes._Zygote(preload=tuple(preload), env=processes.child_env(PYTHONPATH=sys.argv[4]))
if preload[0] == "slow_import":
    processes._zygote.start()
else:
    processes._zygote.socket()
print(json.dumps({"server": processes._zygote.process.pid}), flush=True)
if preload[0] != "slow_import":
    subprocess.Popen(processes.python_command("-c", run, preloaded=True, children=True), env=processes.child_env())
sys.stdin.read()
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: dict[str, int], within_s: float) -> dict[str, int]:
    """The processes of `pids` still alive after `within_s` seconds (or as soon as none is)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(alive(pid) for pid in pids.values()):
        time.sleep(0.05)
    return {name: pid for name, pid in pids.items() if alive(pid)}


@pytest.mark.parametrize("end", ["owner killed", "owner exits", "owner killed while the server imports",
                                 "server killed"])
def test_nothing_the_server_started_outlives_its_owner(tmp_path, end):
    slow = tmp_path / "slow_import.py"  # tells when the server has begun importing it
    slow.write_text("import pathlib, time\npathlib.Path(__file__).with_suffix('.started').touch()\ntime.sleep(0.5)\n")
    preload = "slow_import,json" if end.endswith("imports") else "json"
    pythonpath = os.pathsep.join([str(tmp_path), child_env()["PYTHONPATH"]])
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(REPO), preload, RUN, pythonpath], env=child_env(),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pids = {}
    try:
        pids.update(json.loads(owner.stdout.readline()))
        if end.endswith("imports"):
            while not slow.with_suffix(".started").exists():
                assert alive(pids["server"]), "the server died before importing"
                time.sleep(0.02)
        else:
            pids.update(json.loads(owner.stdout.readline()))
            assert all(alive(pid) for pid in pids.values()), pids
        if end == "owner exits":
            owner.stdin.close()
        elif end == "server killed":
            os.kill(pids["server"], signal.SIGKILL)
        else:
            owner.kill()
        if end == "server killed":  # its forks die with it (the child in a session of its own cannot)
            os.kill(pids.pop("alone"), signal.SIGKILL)
        else:
            owner.wait(timeout=30)
        # A few seconds: the server notices within 0.2 s, or once the module importing has finished.
        left = wait_gone(pids, within_s=4)
        assert left == {}, f"still running 4 s after the {end}: {left}"
    finally:
        owner.kill()
        for pid in pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
