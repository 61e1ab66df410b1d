"""A pre-imported parent for the tests' CLI runs: torch, Megatron-Core, transformers and the trainer
imported once per pytest worker, each run forked from it instead of importing them again.

    subprocess.run(cli_command("train", ..., preloaded=True), env=child_env(), capture_output=True)

Why: a tiny `megatron-rl train` used 15 CPU-s, 6-10 of them importing; the suite starts dozens.

The command is `python -S zygote.py run SOCKET ARGV...`: a client of a few milliseconds, with the shape of
the process it stands for. It passes its argv, environment, working directory and standard streams
(the file descriptors themselves) to the server, which forks; the fork becomes what `python ARGV...`
would be there (sys.argv, sys.path with that PYTHONPATH, environment, cwd, streams, `__main__`) and
runs it, in a session of its own. The client forwards SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2
to it and exits with its exit status (or dies of its signal); a client that dies takes the fork with
it (SIGKILL), and everything below the fork, so a killed test leaves nothing behind.

Nothing the server starts outlives its owner (the pytest worker: `serve SOCKET OWNER_PID`), however
the owner ends (process_tree.py does the killing): the server is the child subreaper of all it
forks, so what a dead process leaves (a vLLM server a run started in a session of its own, the
client standing for it) stays below the server instead of going to init; a run whose client dies
goes with its whole tree; once the owner is gone (polled, between the imports too: an owner killed
while its server imported had left the server idle for good) or asks with SIGTERM (its exit), the
server kills everything below it and leaves; should the server itself be killed, its forks die with
it (PR_SET_PDEATHSIG). Left behind before: the forks of vLLM servers (0.5-1.6 GB each) that
interrupted runs had started, once the owner's exit had killed the server with SIGKILL.

`run --children SOCKET ARGV...` (and `ranks --children`): the run's own Python children are forked
from the server too (its sys.executable is SHIM below): a conversion tool's torchrun and its ranks,
a benchmark's CLI runs, a SLURM job's launcher and ranks, a vLLM server and the engine processes it
spawns (a tiny server healthy in about half the time: each of its processes imported torch and
vLLM for 10-15 s on 2 cores). A fork holds the client's inheritable file descriptors under their
numbers (the pipes a multiprocessing spawn passes its child). A test whose run measures its
children (their memory, their CPU time) leaves them fresh.

What stays different from a fresh process, so a test that depends on it keeps one (the default):
modules imported in the server read their environment at import time, not the run's (vLLM's
logging, configured at import, is configured again from the run's; the variables the imports set
are set in the run's environment unless it has them); the fork is not the client's
child (RUSAGE_CHILDREN, process trees, a signal to the client's process group); its resident
memory starts with pages shared with the server (a peak read from VmHWM is another figure);
import-time warnings are not printed again; the hash seed is the server's. A `sitecustomize.py` in a
directory of the run's PYTHONPATH runs in the fork, as `site` runs it at a fresh start, but after
the server's imports: a hook that waits for a module's import must also act on a module imported
already (tests/tools/pause_hook/sitecustomize.py does). A process orphaned below a run goes to the
server, not to init.
"""

from __future__ import annotations

import json
import os
import select
import shlex
import signal
import socket
import sys
import time

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
MAX_FDS = 64  # passed to a fork (SCM_RIGHTS takes up to 253)
# Imported once by the server: what every CLI run imports before its first step. Not wandb's
# service (threads).
PRELOAD = (
    "torch", "transformers", "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
    "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.pipeline_parallel",
    "megatron.core.dist_checkpointing", "megatron_rl.cli", "megatron_rl.model.policy", "megatron_rl.train.trainer",
    "megatron_rl.bridge", "matplotlib.pyplot",
)
# And vLLM's where it is installed: the colocated engine's (2.8 CPU-s per run measured), a server's
# and its engine core's.
# vLLM configures its logging from the environment at import: the fork configures it again from
# the run's (_become).
PRELOAD_IF_INSTALLED = ("vllm", "vllm.entrypoints.llm", "vllm.inputs", "megatron_rl.rollout.engines.vllm_colocated",
                        "vllm.entrypoints.openai.api_server", "vllm.v1.engine.core", "vllm.v1.worker.cpu_worker")


# ------------------------------------------------------------------------------------------------
# The client: stands for `python ARGV...` (stdlib only; started with -S).
# ------------------------------------------------------------------------------------------------


def _recv_line(conn: socket.socket) -> bytes | None:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            return None
        data += chunk
    return data


def _connect(path: str) -> socket.socket | None:
    deadline = time.monotonic() + 300  # the server may still be importing
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
            if time.monotonic() > deadline:
                print(f"zygote: no server at {path}", file=sys.stderr)
                return None
            time.sleep(0.1)
    return conn


def _start(path: str, argv: list[str], env: dict, children: bool) -> tuple[socket.socket, int] | None:
    """One run forked by the server: its connection and pid."""
    conn = _connect(path)
    if conn is None:
        return None
    fds = _open_fds()
    request = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(), "children": children,
                          "fds": fds}).encode() + b"\n"
    socket.send_fds(conn, [request], fds)
    reply = _recv_line(conn)
    if reply is None:
        print("zygote: the server closed the connection before starting the run", file=sys.stderr)
        return None
    return conn, json.loads(reply)["pid"]


def _open_fds() -> list[int]:
    """The file descriptors this client was given: its standard streams and whatever its starter
    passed on, such as the pipes a multiprocessing spawn reads its process object from (the
    inheritable ones; the client's own connections are not). The fork gets each under its number."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.get_inheritable(int(name)):
                fds.append(int(name))
        except OSError:  # the listing's own descriptor, closed by now
            continue
    return sorted(fds)[:MAX_FDS]


def client(path: str, argv: list[str], children: bool = False) -> int:
    started = _start(path, argv, dict(os.environ), children)
    if started is None:
        return 70
    conn, pid = started
    for signum in FORWARDED:
        signal.signal(signum, lambda s, _f: os.kill(pid, s))
    status = _recv_line(conn)
    if status is None:
        print("zygote: the server went away during the run", file=sys.stderr)
        return 70
    code = json.loads(status)
    if code["signal"]:  # die of the same signal, as the run did
        if code["signal"] != signal.SIGKILL:
            signal.signal(code["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), code["signal"])
    return code["exit"]


def ranks(path: str, nproc: int, port: int, argv: list[str], children: bool = False) -> int:
    """Stands for `torchrun --nproc-per-node=NPROC --master-port=PORT ARGV...` on one node: NPROC
    runs with the environment torchrun gives its ranks (rank 0 hosts the rendezvous store, as
    without torchrun's agent). As torchrun does: when one rank fails the others are stopped
    (SIGTERM, then SIGKILL after 30 s), the failure is named on stderr, and the exit status is 1."""
    runs = {}
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                   ROLE_NAME="default", WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                   ROLE_WORLD_SIZE=str(nproc), GROUP_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                   TORCHELASTIC_RUN_ID="none")
        env.setdefault("OMP_NUM_THREADS", "1")
        started = _start(path, argv, env, children)
        if started is None:
            for _conn, pid in runs.values():
                os.kill(pid, signal.SIGKILL)
            return 70
        runs[rank] = started
    for signum in FORWARDED:
        signal.signal(signum, lambda s, _f: [_signal(pid, s) for _c, pid in runs.values()])
    failed, stopped, kill_at = {}, set(), None
    pending = dict(runs)
    while pending:
        readable, _, _ = select.select([conn for conn, _pid in pending.values()], [], [], 0.5)
        for rank in [r for r, (conn, _pid) in pending.items() if conn in readable]:
            line = _recv_line(pending.pop(rank)[0])
            code = json.loads(line) if line else {"exit": 70, "signal": 0}
            if code["exit"] or code["signal"]:
                failed[rank] = code
        if failed and kill_at is None and pending:
            stopped.update(pending)
            for _conn, pid in pending.values():
                _signal(pid, signal.SIGTERM)
            kill_at = time.monotonic() + 30
        if kill_at is not None and time.monotonic() > kill_at:
            for _conn, pid in pending.values():
                _signal(pid, signal.SIGKILL)
    for rank, code in sorted(failed.items()):
        how = f"signal {code['signal']}" if code["signal"] else f"exit code {code['exit']}"
        why = "stopped after another rank failed" if rank in stopped else "failed"
        print(f"zygote ranks: rank {rank} ({argv[0]}) {why}: {how}", file=sys.stderr)
    return 1 if failed else 0


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


# ------------------------------------------------------------------------------------------------
# The server: imports, then forks one child per request.
# ------------------------------------------------------------------------------------------------


# `python` as a run forked with --children sees it (sys.executable): a script, `-m MODULE` or
# `-c CODE` is forked from the server too, with --children again, so a tool's torchrun and its
# ranks, a benchmark's runs, a vLLM server and the engine processes it spawns (multiprocessing's
# spawn: its pipes are passed on under their numbers) import nothing; the interpreter itself runs
# what needs a real one: interpreter flags (the sandbox's -I -S), SGLang servers.
SHIM = """#!/bin/sh
real={real}
unbuffered=
while :; do
  case "$1" in
    -u) unbuffered=1; shift ;;
    -B) PYTHONDONTWRITEBYTECODE=1; export PYTHONDONTWRITEBYTECODE; shift ;;  # as a spawn passes it on
    *) break ;;
  esac
done
case "$1" in
  -m) case "$2" in sglang.*) direct=1 ;; *) direct= ;; esac ;;
  -c) direct= ;;
  ""|-*) direct=1 ;;
  *) direct= ;;
esac
if [ -n "$direct" ]; then
  if [ -n "$unbuffered" ]; then exec "$real" -u "$@"; fi
  exec "$real" "$@"
fi
if [ -n "$unbuffered" ]; then PYTHONUNBUFFERED=1; export PYTHONUNBUFFERED; fi
exec "$real" -S {script} run --children {socket} "$@"
"""


def shim_path(path: str) -> str:
    """The SHIM of the server at socket `path` (beside it)."""
    return os.path.join(os.path.dirname(path), "python")


def write_shim(path: str) -> None:
    """SHIM for the server at socket `path`, written before the server starts (so it is there as
    soon as a test asks for it)."""
    shim = shim_path(path)
    with open(shim, "w") as out:
        out.write(SHIM.format(real=shlex.quote(sys.executable), script=shlex.quote(os.path.abspath(__file__)),
                              socket=shlex.quote(path)))
    os.chmod(shim, 0o755)


def _run_sitecustomize(directories: list[str]) -> None:
    """What `site` does at start-up with the first sitecustomize.py of these directories (the run's
    own PYTHONPATH): run it as the module `sitecustomize`."""
    import importlib.util

    for directory in directories:
        path = os.path.join(directory, "sitecustomize.py")
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("sitecustomize", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules["sitecustomize"] = module
            spec.loader.exec_module(module)
            return


def _become(request: dict, fds: list[int], server_pythonpath: set[str], shim: str, imported_env: dict,
            server: int) -> None:
    """In the fork: turn into `python ARGV...` and run it; never returns."""
    import runpy
    import threading
    import traceback

    import process_tree  # imported by the server (beside this script)

    code, died_of = 0, 0
    try:
        # A server killed outright (not through its SIGTERM) takes its forks along.
        process_tree.prctl(process_tree.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != server:  # it died before that line
            os._exit(1)
        os.setsid()
        # Each descriptor to its number in the client, moved out of the way first so that one
        # received under another's number is not overwritten before it is placed.
        import fcntl

        targets = request["fds"]
        above = max(targets, default=2) + 1
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, above) for fd in fds]
        for fd in fds:
            os.close(fd)
        for target, fd in zip(targets, moved):
            os.dup2(fd, target)  # inheritable, as in the client
        for fd in moved:
            os.close(fd)
        # As a fresh interpreter has them: SIGINT raises KeyboardInterrupt (so a run's finally blocks
        # and exit functions run on Ctrl-C; SIG_DFL had killed it at once, leaving what it had started).
        fresh = {signal.SIGINT: signal.default_int_handler, signal.SIGPIPE: signal.SIG_IGN}
        for signum in (*FORWARDED, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(signum, fresh.get(signum, signal.SIG_DFL))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for name, value in imported_env.items():  # what the preloaded modules' imports set, as in a fresh run
            os.environ.setdefault(name, value)
        if "vllm.logger" in sys.modules:  # configured from the server's environment at import
            sys.modules["vllm.logger"]._configure_vllm_root_logger()
        argv = request["argv"]
        pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        base = [p for p in sys.path[1:] if p not in server_pythonpath]
        if "torch" in sys.modules:  # preloaded: its thread count was read from the server's environment
            sys.modules["torch"].set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        if os.environ.get("PYTHONUNBUFFERED"):  # the streams were made by the server, buffered
            sys.stdout.reconfigure(write_through=True)
            sys.stderr.reconfigure(write_through=True)
        if request.get("children"):
            import multiprocessing

            multiprocessing.set_executable(shim)  # a spawn is forked from the server too
            sys.executable = shim
        _run_sitecustomize([p for p in pythonpath if p not in server_pythonpath])
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[:] = [os.getcwd(), *pythonpath, *base]
            sys.modules.pop(argv[1], None)  # preloaded as a module; it runs again as __main__
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[:] = ["", *pythonpath, *base]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = list(argv)
            sys.path[:] = [os.path.dirname(os.path.abspath(argv[0])), *pythonpath, *base]
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:  # the interpreter prints it, exits as below (atexit too), then dies of SIGINT
        traceback.print_exc()
        died_of = signal.SIGINT
    except BaseException:  # what the interpreter would print, and its exit status
        traceback.print_exc()
        code = 1
    try:  # what the interpreter does at exit: non-daemon threads, atexit, flushed streams
        threading._shutdown()
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if died_of:
            signal.signal(died_of, signal.SIG_DFL)
            os.kill(os.getpid(), died_of)
        os._exit(code)


def serve(path: str, owner: int, preload: list[str] | None = None) -> None:
    """Imports (`preload`: these modules instead of PRELOAD and PRELOAD_IF_INSTALLED), then forks a
    run per request until `owner` is gone or sends SIGTERM; then kills every process below it."""
    import importlib
    import warnings

    import process_tree  # beside this script: its directory is sys.path[0]

    pythonpath = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}  # a run's own replaces it
    before = dict(os.environ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in PRELOAD if preload is None else preload:
            if os.getppid() != owner:  # killed while its server imported: nobody will connect
                return
            importlib.import_module(name)
        for name in PRELOAD_IF_INSTALLED if preload is None else ():
            if os.getppid() != owner:
                return
            try:
                importlib.import_module(name)
            except ImportError:
                break
    imported_env = {name: value for name, value in os.environ.items() if before.get(name) != value}
    shim = shim_path(path)
    stopping = []
    signal.signal(signal.SIGTERM, lambda _s, _f: stopping.append(True))  # the owner's exit (processes.py)
    process_tree.prctl(process_tree.PR_SET_CHILD_SUBREAPER, 1)  # orphans below the server stay below it, not under init
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # clients connect only once the imports are done
    listener.listen(64)
    server = os.getpid()
    running: dict[int, socket.socket | None] = {}  # child pid -> its client's connection (None: client gone)
    while os.getppid() == owner and not stopping:
        readable, _, _ = select.select([listener, *(c for c in running.values() if c)], [], [], 0.2)
        for conn in readable:
            if conn is listener:
                accepted, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(accepted, 1 << 20, MAX_FDS)
                while not message.endswith(b"\n"):
                    message += accepted.recv(1 << 20)
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in running.values():
                        if other is not None:
                            other.close()
                    accepted.close()
                    _become(json.loads(message), fds, pythonpath, shim, imported_env, server)
                for fd in fds:
                    os.close(fd)
                accepted.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                running[pid] = accepted
            elif not conn.recv(1, socket.MSG_PEEK):  # the client died: so does its run, and what it started
                pid = next(p for p, c in running.items() if c is conn)
                process_tree.kill_tree(pid)
                running[pid] = None
                conn.close()
        for pid, status in process_tree.reaped():  # its forks, and the orphans it adopted
            conn = running.pop(pid, None)
            if conn is not None:
                result = {"exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1,
                          "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0}
                try:
                    conn.sendall(json.dumps(result).encode() + b"\n")
                except OSError:
                    pass
                conn.close()
    process_tree.kill_everything_below(server)


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    forked_children = rest[:1] == ["--children"]
    rest = rest[1:] if forked_children else rest
    if mode == "run":
        sys.exit(client(rest[0], rest[1:], forked_children))
    if mode == "ranks":
        sys.exit(ranks(rest[0], int(rest[1]), int(rest[2]), rest[3:], forked_children))
    # serve SOCKET [OWNER_PID (the parent)] [--preload MODULE...]
    owner, options = (int(rest[1]), rest[2:]) if rest[1:2] and rest[1].isdigit() else (os.getppid(), rest[1:])
    serve(rest[0], owner, options[1:] if options[:1] == ["--preload"] else None)
