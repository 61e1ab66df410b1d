"""The pre-imported server the suite forks CLI runs and pool ranks from (tests/_support/zygote.py):
a run through it must look, to the test, like `python ARGV...` started fresh (argv, sys.path from
its PYTHONPATH, environment, working directory, streams, exit status, signals), while its heavy
imports are already done. Compared with a fresh process running the same probe."""

import json
import os
import subprocess
import time

import pytest

from _support.processes import child_env, python_command

pytestmark = pytest.mark.subprocess

PROBE = """
import json, os, sys
preloaded = "torch" in sys.modules  # before anything is imported here
sys.stderr.write("to stderr\\n")
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("PROBE_VALUE"),
                  "path_head": sys.path[:3], "main": __name__, "preloaded": preloaded,
                  "stdin": sys.stdin.read(), "site": os.environ.get("PROBE_SITE")}))
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("form", ["script", "-c"])
def test_a_run_through_the_server_is_the_fresh_run_with_imports_done(tmp_path, form):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    extra = tmp_path / "plugins"
    extra.mkdir()
    # A hook on the run's PYTHONPATH, which `site` runs at start-up (the tests' pause hooks are such)
    (extra / "sitecustomize.py").write_text("import os\nos.environ['PROBE_SITE'] = 'ran as ' + __name__\n")
    argv = [script, "3", "x y"] if form == "script" else ["-c", PROBE, "3", "x y"]
    env = child_env(PROBE_VALUE="seen", PYTHONPATH=f"{extra}{os.pathsep}{child_env()['PYTHONPATH']}")
    outputs = {}
    for preloaded in (False, True):
        result = subprocess.run(python_command(*argv, preloaded=preloaded), env=env, cwd=tmp_path, input="from stdin",
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 3, result.stderr
        assert result.stderr.endswith("to stderr\n"), result.stderr
        outputs[preloaded] = json.loads(result.stdout)
    fresh, forked = outputs[False], outputs[True]
    assert (fresh["preloaded"], forked["preloaded"]) == (False, True)
    for key in ("argv", "cwd", "env", "main", "stdin", "path_head", "site"):
        assert forked[key] == fresh[key], key
    assert forked["site"] == "ran as sitecustomize"
    assert str(extra) in forked["path_head"]


def start_preloaded(code: str) -> subprocess.Popen:
    return subprocess.Popen(python_command("-c", code, preloaded=True), env=child_env(), stdout=subprocess.PIPE,
                            text=True)


def wait_for_line(process) -> str:
    line = process.stdout.readline()
    assert line, "the run printed nothing"
    return line.strip()


def test_signals_reach_the_run_and_its_status_comes_back():
    handler = ("import signal, sys, time\n"
               "signal.signal(signal.SIGTERM, lambda *a: (print('stopping', flush=True), sys.exit(7)))\n"
               "print('ready', flush=True)\ntime.sleep(120)")
    process = start_preloaded(handler)
    assert wait_for_line(process) == "ready"
    process.terminate()
    assert process.wait(timeout=60) == 7
    assert process.stdout.read().strip() == "stopping"

    dies = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert subprocess.run(python_command("-c", dies, preloaded=True), env=child_env(), timeout=60).returncode == -9

    # Ctrl-C: the interpreter runs the exit functions (vLLM's shared memory is released by one),
    # then dies of SIGINT.
    interrupted = ("import atexit, os, signal\natexit.register(print, 'exit functions ran', flush=True)\n"
                   "os.kill(os.getpid(), signal.SIGINT)\nimport time; time.sleep(60)")
    for preloaded in (False, True):
        result = subprocess.run(python_command("-c", interrupted, preloaded=preloaded), env=child_env(),
                                capture_output=True, text=True, timeout=60)
        assert (result.returncode, result.stdout) == (-2, "exit functions ran\n"), (preloaded, result.stderr)


def test_a_killed_client_takes_the_run_and_its_children_with_it():
    spawn = ("import subprocess, sys, time\n"
             "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
             "import os\nprint(os.getpid(), child.pid, flush=True)\ntime.sleep(120)")
    process = start_preloaded(spawn)
    pids = [int(p) for p in wait_for_line(process).split()]
    process.kill()
    process.wait(timeout=60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids), pids


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_server_never_forks_with_a_thread_of_python_running():
    """A fork copies only the forking thread; a Python thread holding a lock at that moment would
    leave it held in every run. The server imports nothing that starts one."""
    probe = "import threading; print(threading.active_count())"
    result = subprocess.run(python_command("-c", probe, preloaded=True), env=child_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.stdout.strip() == "1", result.stdout + result.stderr


CHILD_PROBE = """
import subprocess, sys
def child(*flags):
    code = "import sys; print('torch' in sys.modules)"
    return subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
print(child(), child("-I"))
"""


@pytest.mark.parametrize("children", [False, True])
def test_with_children_the_runs_own_python_children_are_forked_too(children):
    """children=True: the run's `sys.executable ...` children come from the server too (torch is
    imported before their first line); a child with interpreter flags (the sandbox's -I) is the
    real interpreter. Without it every child is the real interpreter."""
    result = subprocess.run(python_command("-c", CHILD_PROBE, preloaded=True, children=children), env=child_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == (["True", "False"] if children else ["False", "False"]), result.stdout


SPAWN_PROBE = """
import multiprocessing, os, subprocess, sys

def child(queue):
    queue.put("torch" in sys.modules)
    sys.exit(3)

if __name__ == "__main__":
    spawn = multiprocessing.get_context("spawn")
    queue = spawn.Queue()
    process = spawn.Process(target=child, args=(queue,))
    process.start()
    preloaded = queue.get(timeout=120)
    process.join()
    read, write = os.pipe()
    os.write(write, b"through")
    os.close(write)
    code = f"import os, sys; print(os.read({read}, 16).decode(), 'torch' in sys.modules)"
    passed = subprocess.run([sys.executable, "-c", code], pass_fds=(read,), capture_output=True, text=True)
    print(preloaded, process.exitcode, passed.stdout.strip(), passed.returncode)
"""


def test_with_children_a_multiprocessing_spawn_is_forked_with_its_pipes(tmp_path):
    """children=True: a `multiprocessing` spawn (how vLLM starts its engine processes on CPU) comes
    from the server too: the child gets its process object through the pipes spawn passes it
    (under their numbers), runs preloaded, and its exit status comes back; a descriptor a run
    passes to its own child (pass_fds) reaches the fork under its number."""
    script = tmp_path / "spawn_probe.py"
    script.write_text(SPAWN_PROBE)
    result = subprocess.run(python_command(script, preloaded=True, children=True), env=child_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "3", "through", "True", "0"], result.stdout + result.stderr


def test_a_fork_configures_vllms_logging_from_its_own_environment():
    """vLLM, preloaded, configured its logger from the server's environment at import; each run
    gets the level its own VLLM_LOGGING_LEVEL says, as a fresh import would give it."""
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")
    probe = "import logging, sys; print('vllm' in sys.modules, logging.getLevelName(logging.getLogger('vllm').level))"
    for level in ("DEBUG", "ERROR"):
        result = subprocess.run(python_command("-c", probe, preloaded=True), env=child_env(VLLM_LOGGING_LEVEL=level),
                                capture_output=True, text=True, timeout=300)
        assert result.stdout.split() == ["True", level], result.stdout + result.stderr
