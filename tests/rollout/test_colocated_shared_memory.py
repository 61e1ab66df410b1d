"""Colocated vLLM CPU engines' shared memory (runtime/cpu/vllm_shm.py): a crashed run no longer
blocks the next one, two runs share a host, and a finished run leaves none of its segments nor its
TP message queue (psm_); a stopped vLLM server leaves none of its processes' segments either.

vLLM's CPU build named the segments after the init method (`env://`), the same for every run: a
rank killed with SIGKILL left them in /dev/shm and every re-run failed at engine start with
`create shm in SHMManager failed. errno: 17`. Only vLLM's AVX-512 kernels use these segments (its
AVX2 build has no shared-memory communicator), so on an AVX2-only CPU the collision itself cannot
occur; the test plants a dead run's segments under both namings (the old shared name, and one of
ours whose run is gone), which on an AVX-512 machine reproduces the failure, and on every machine
checks that the re-run removes them and says so. That vLLM takes each run's own name is checked
in test_vllm_sync.py (the colocated TP2 / EP2 cases) on any CPU.

A run that ended normally left its own segments on an Intel Xeon (2 x 4 MiB per TP2 engine):
vLLM unlinks them only in a C++ destructor at the process's C exit, which a rank forked from the
tests' pre-imported server (it ends with os._exit) never reaches. The engine now removes its
run's segments at shutdown, and at the process's exit otherwise. The runs here carry
shm_hook/sitecustomize.py: where vLLM's kernels have no shared-memory ops (AVX2) it gives vLLM's
own communicator stand-in ops that make the segments as vLLM's C++ does, and on every CPU it
records the segments each run made, so the finished runs' check is made on both CPU families, and
on the segments those runs made (not on other tests' runs). The removal itself is checked
without any of this by the unit tests below.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from _support.processes import REPO, child_env, cli_command
from megatron_rl.runtime.cpu.vllm_shm import RunSegments, remove_run_segments, run_identifier, stale_segments

SHM = Path("/dev/shm")
HOOK = Path(__file__).parent / "shm_hook"  # sitecustomize.py: vLLM's CPU shared-memory communicator on every CPU
# One RL step and no Hugging Face export: the runs must start their engines, train, push and end
# (what the segments are about), not export.
SHORT = ["parallel.ep=2", "parallel.etp=1", "rl.prompts_per_step=4", "rl.group_size=2", "rl.updates_per_rollout=1",
         "rl.max_response_tokens=4", "warm_start.steps=0", "data.num_heldout=4", "rl.eval_every=0", "rl.steps=1",
         "checkpoint.export_hf=false", "logging.wandb_mode=disabled"]


def test_stale_segments_are_the_unmapped_old_ones(tmp_path):
    """Unit: which files count as a dead run's (fake /dev/shm and /proc trees)."""
    shm, proc = tmp_path / "shm", tmp_path / "proc"
    shm.mkdir()
    (proc / "4242").mkdir(parents=True)
    names = ["-tp:0-[0-1]-cpushm_0", "megatron-rl-7-ab-tp:0-[0-1]-cpushm_1", "in-use-tp:0-[0-1]-cpushm_0",
             "young-tp:0-[0-1]-cpushm_0", "psm_1234"]
    for name in names:
        (shm / name).write_bytes(b"x")
    old = time.time() - 3600
    for name in names[:3] + names[4:]:
        os.utime(shm / name, (old, old))
    (proc / "4242" / "maps").write_text(f"7f00-7f10 rw-s 00000000 00:1a 12 {SHM}/in-use-tp:0-[0-1]-cpushm_0\n")
    found = [path.name for path in stale_segments(shm, proc)]
    assert found == sorted(names[:2]), found  # not the mapped one, the young one, nor other files


def vllm_segments(identifier: str, ranks: int = 2) -> list[str]:
    """The names vLLM's CPU build gives an engine's TP group: `_CPUSHMDistributed.make_group_name`
    (VLLM_DIST_IDENT, which the CPU worker takes from the init-method file name the project hands
    it, then the group and its ranks) and the C++ SHMManager's `_{rank}` (csrc/cpu/shm.cpp)."""
    group = "[" + "-".join(str(rank) for rank in range(ranks)) + "]"
    return [f"{identifier}-tp:0-{group}-cpushm_{rank}" for rank in range(ranks)]


def make_segment(path: Path) -> mmap.mmap:
    """A segment as vLLM's SHMManager makes it (created exclusively, truncated, mapped shared)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        return mmap.mmap(fd, mmap.PAGESIZE, mmap.MAP_SHARED)
    finally:
        os.close(fd)


def test_a_run_removes_its_own_segments_and_no_one_elses(tmp_path):
    """Unit: at shutdown a run unlinks its segments (one still mapped by a rank, which keeps using
    it), and leaves a live run's, a dead run's (the next start's stale removal is theirs) and
    files that are not vLLM's."""
    mine, live, dead = run_identifier(), run_identifier(), run_identifier()
    assert len({mine, live, dead}) == 3 and mine.startswith("megatron-rl-")
    maps = {}
    for name in vllm_segments(mine) + vllm_segments(live) + vllm_segments(dead):
        maps[name] = make_segment(tmp_path / name)
    for name in vllm_segments(dead):
        maps.pop(name).close()
    others = [f"{mine}x-tp:0-[0-1]-cpushm_0", mine, "psm_1234"]  # a longer identifier; not segments
    for name in others:
        (tmp_path / name).write_bytes(b"x")
    mapped = maps[vllm_segments(mine)[1]]  # the other rank, still mapping its segment
    mapped[:5] = b"hello"

    shm = RunSegments(mine, tmp_path)
    assert shm.release() == vllm_segments(mine)
    assert mapped[:5] == b"hello"  # unlinked, still mapped and usable
    mapped[:5] = b"later"
    assert mapped[:5] == b"later"
    left = sorted(path.name for path in tmp_path.iterdir())
    assert left == sorted(vllm_segments(live) + vllm_segments(dead) + others), left
    assert shm.release() == [] and remove_run_segments(mine, tmp_path) == []  # once; the other rank's call finds none
    for mapping in maps.values():
        mapping.close()


EXIT_SCRIPT = """
import atexit, os, sys
from pathlib import Path
from megatron_rl.runtime.cpu.vllm_shm import RunSegments
RunSegments(sys.argv[1], Path(sys.argv[2]))
how = sys.argv[3]
if how == "zygote":  # a fork of the tests' pre-imported server: atexit, then os._exit (zygote.py)
    atexit._run_exitfuncs()
    os._exit(0)
if how == "killed":  # no exit path at all (SIGKILL): the next run's stale removal takes them
    os._exit(0)
if how == "error":
    raise RuntimeError("the engine did not start")
if how == "forked":  # a child of the rank (its atexit entries with it) ends first: the run goes on
    child = os.fork()
    if child == 0:
        sys.exit(0)
    os.waitpid(child, 0)
    print(len(list(Path(sys.argv[2]).iterdir())))
    os._exit(0)
"""


@pytest.mark.parametrize("how,removed", [("normal", True), ("error", True), ("zygote", True), ("killed", False),
                                         ("forked", False)])
def test_a_process_that_never_shut_its_engine_down_removes_its_segments_at_exit(tmp_path, how, removed):
    """Unit: an engine that failed while it started, or was never shut down: its run's segments go
    when the process exits, also by the os._exit path of a fork of the pre-imported server."""
    identifier = run_identifier()
    for name in vllm_segments(identifier) + vllm_segments(run_identifier()):
        (tmp_path / name).write_bytes(b"x")
    result = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, identifier, str(tmp_path), how],
                            env=child_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == (1 if how == "error" else 0), result.stderr
    if how == "forked":
        assert result.stdout.split() == ["4"], result.stdout  # the child's exit removed nothing
    left = [path.name for path in tmp_path.iterdir()]
    mine = [name for name in left if name.startswith(f"{identifier}-")]
    assert len(mine) == (0 if removed else 2) and len(left) - len(mine) == 2, left  # the other run's stay


def test_engine_shutdown_removes_its_run_segments(tmp_path):
    """Unit: VllmColocatedEngine.shutdown unlinks the engine's segments on this rank, even when
    vLLM's executor fails to shut down."""
    from megatron_rl.rollout.engines.vllm_colocated import VllmColocatedEngine

    def engine(identifier: str, fail: bool) -> VllmColocatedEngine:
        def shutdown():
            if fail:
                raise RuntimeError("executor shutdown failed")

        core = SimpleNamespace(model_executor=SimpleNamespace(shutdown=shutdown),
                               scheduler=SimpleNamespace(shutdown=lambda: None))
        client = SimpleNamespace(_finalizer=SimpleNamespace(detach=lambda: None), engine_core=core)
        made = VllmColocatedEngine.__new__(VllmColocatedEngine)
        made.name, made._closed = "vllm-colocated", False
        made._llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=client))
        made._shm = RunSegments(identifier, tmp_path)
        return made

    first, second, live = run_identifier(), run_identifier(), run_identifier()
    for name in vllm_segments(first) + vllm_segments(second) + vllm_segments(live):
        (tmp_path / name).write_bytes(b"x")
    engine(first, fail=False).shutdown()
    failing = engine(second, fail=True)
    with pytest.raises(RuntimeError, match="executor shutdown failed"):
        failing.shutdown()
    assert sorted(path.name for path in tmp_path.iterdir()) == vllm_segments(live)
    failing.shutdown()  # closed already: nothing again


class _Group:
    """A vLLM group coordinator, for its message queue (weakly referenced, as vLLM's `_groups` does)."""

    def __init__(self, queue):
        self.mq_broadcaster = queue


def test_engine_shutdown_unlinks_the_tp_message_queue_on_the_rank_that_made_it(monkeypatch):
    """Unit: a TP group's message queue keeps a ring buffer in /dev/shm/psm_* (24 MiB), made by the
    group's rank 0 and freed only when the group is destroyed, which the engine must not do, or by
    Python's resource tracker at exit (`resource_tracker: There appear to be 1 leaked
    shared_memory objects` after every colocated TP2 run; a leak if it is killed). The engine's
    shutdown unlinks it where it was made, unregistered from the tracker; the reader (here in the
    same process) only closes its mapping, and neither's later collection unlinks anything again."""
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")
    import gc
    import weakref
    from multiprocessing import resource_tracker

    from vllm.distributed import parallel_state
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    from megatron_rl.rollout.engines.vllm_colocated import VllmColocatedEngine

    tracked = []  # what the resource tracker would warn about at exit (not started here)
    monkeypatch.setattr(resource_tracker, "register", lambda name, kind: tracked.append(name))
    monkeypatch.setattr(resource_tracker, "unregister", lambda name, kind: tracked.remove(name))
    writer = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=4096, max_chunks=2)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    segment = SHM / writer.buffer.shared_memory.name
    try:
        assert segment.name.startswith("psm_") and segment.exists() and tracked == [f"/{segment.name}"]
        assert writer.buffer.is_creator and not reader.buffer.is_creator
        groups = [_Group(writer), _Group(reader)]  # rank 0's TP group, rank 1's
        monkeypatch.setattr(parallel_state, "_groups", {f"tp:{index}": weakref.ref(group)
                                                        for index, group in enumerate(groups)})
        core = SimpleNamespace(model_executor=SimpleNamespace(shutdown=lambda: None),
                               scheduler=SimpleNamespace(shutdown=lambda: None))
        client = SimpleNamespace(_finalizer=SimpleNamespace(detach=lambda: None), engine_core=core)
        engine = VllmColocatedEngine.__new__(VllmColocatedEngine)
        engine.name, engine._closed, engine._shm = "vllm-colocated", False, None
        engine._llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=client))
        engine.shutdown()
        assert not segment.exists() and tracked == []
        assert [group.mq_broadcaster for group in groups] == [None, None]  # broadcasts go through torch.distributed
        assert writer.buffer.shared_memory.buf is None and reader.buffer.shared_memory.buf is None  # closed
        unraisable = []
        monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
        del writer, reader, groups
        gc.collect()
        assert unraisable == []  # ShmRingBuffer.__del__ did not unlink it a second time
    finally:
        segment.unlink(missing_ok=True)


def test_server_segments_are_the_ones_its_processes_mapped(tmp_path):
    """Unit: the segments a server's processes mapped while they ran, noted by identifier
    (vLLM 0.32's mp executor: `vllm_dist_{uuid}`; over TCP: the port) and, for message queues, by
    name, go once they are gone; another server's stay, and so does a queue a live process maps."""
    from uuid import uuid4

    from megatron_rl.runtime.cpu.vllm_shm import ServerSegments, segment_identifier

    mine, port, other = f"vllm_dist_{uuid4().hex}", "45678", f"vllm_dist_{uuid4().hex}"
    assert segment_identifier(vllm_segments(mine)[1]) == mine and segment_identifier(vllm_segments(port)[0]) == port
    assert segment_identifier("megatron-rl-7-ab12cd34-pp:1-[0-1]-cpushm_1") == "megatron-rl-7-ab12cd34"
    assert segment_identifier("psm_1234") is None
    extra = [f"{mine}-pp:0-[0-1]-cpushm_0"]  # one no process of the server mapped: its identifier's
    for name in vllm_segments(mine) + vllm_segments(port) + vllm_segments(other) + extra + ["psm_a1", "psm_b2"]:
        (tmp_path / name).write_bytes(b"x")
    proc = tmp_path / "proc"

    def maps(pid: int, *names: str) -> None:
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "maps").write_text("".join(f"7f00-7f10 rw-s 00000000 00:1a 12 {SHM}/{name}\n"
                                                      for name in names))

    maps(100, *vllm_segments(mine), "psm_a1", "psm_b2")  # the server's worker of rank 0
    maps(101, *vllm_segments(port), "/not-ours (deleted)")  # rank 1
    maps(4242, *vllm_segments(other), "psm_b2")  # another live process
    server = ServerSegments(tmp_path, proc)
    server.note([100, 101, 999])  # 999: ended meanwhile
    assert server.identifiers == {mine, port} and server.queues == {"psm_a1", "psm_b2"}
    for pid in (100, 101):
        shutil.rmtree(proc / str(pid))  # the server's processes are reaped
    assert sorted(server.remove()) == sorted(vllm_segments(mine) + vllm_segments(port) + extra + ["psm_a1"])
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(vllm_segments(other) + ["proc", "psm_b2"])
    assert server.remove() == []


SERVER_SCRIPT = """
import mmap, os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a worker stuck past the grace period: SIGKILL
maps = []
for name in sys.argv[1:]:
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, mmap.PAGESIZE)
    maps.append(mmap.mmap(fd, mmap.PAGESIZE, mmap.MAP_SHARED))
    os.close(fd)
if os.fork() == 0:  # a worker of the server: the same process group, the same mappings
    time.sleep(600)
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["killed after the grace period", "died before stop"])
def test_a_stopped_server_leaves_none_of_its_segments(tmp_path, how):
    """A vLLM server's CPU workers (TP2, AVX-512) name theirs `{VLLM_DIST_IDENT}-tp:0-[0-1]-cpushm_N`
    and vLLM unlinks them only in a C++ destructor at exit: a worker killed with SIGKILL after the
    stop's grace period, or dead before it, left them in /dev/shm, with its message queues' psm_
    (their resource tracker dies with the group). Here a stand-in server group maps segments named
    as vLLM names them; the stop removes them after reaping the group, and no one else's."""
    from uuid import uuid4

    from megatron_rl.rollout.engines.server_process import ServerProcess, _group_alive, _group_members

    identifier = f"vllm_dist_{uuid4().hex}"
    names = vllm_segments(identifier) + [f"psm_{uuid4().hex[:8]}"]
    unrelated = SHM / vllm_segments(f"vllm_dist_{uuid4().hex}")[0]
    unrelated.write_bytes(b"x")
    process = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT, *names], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        assert all((SHM / name).exists() for name in names)
        server = ServerProcess(process, "http://127.0.0.1:9", tmp_path / "server.log", "vllm-test")
        if how == "died before stop":
            server.segments.note(_group_members(process.pid))  # what launch() does once the server is up
            os.killpg(process.pid, signal.SIGKILL)
            while _group_alive(process.pid):
                process.poll()
                time.sleep(0.05)
        server.stop(grace_s=0.5)
        assert not _group_alive(process.pid)
        assert [name for name in names if (SHM / name).exists()] == [], "the stopped server's segments are left"
        assert unrelated.exists()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for path in [SHM / name for name in names] + [unrelated]:
            path.unlink(missing_ok=True)


def launch(out: Path, preloaded: bool = True, shm_log: Path | None = None) -> subprocess.Popen:
    """`megatron-rl launch local` on 2 ranks; preloaded: the launcher, its torchrun and the ranks
    forked from the pre-imported server. shm_log: the run carries shm_hook/, which writes there
    the shared-memory segments its ranks made and each rank's pid (how the test finds the rank it
    kills: a forked rank is not a descendant of the launcher's process)."""
    command = cli_command("launch", "local", "--nproc-per-node", "2", "--output-dir", str(out), *SHORT,
                          preloaded=preloaded, children=preloaded)
    env = child_env() if shm_log is None else child_env(PYTHONPATH=f"{HOOK}{os.pathsep}{REPO}",
                                                        MEGATRON_RL_TEST_SHM_LOG=str(shm_log))
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def segments_made(shm_log: Path) -> list[dict]:
    return [json.loads(line) for line in shm_log.read_text().splitlines()] if shm_log.is_file() else []


def remove_segments_of(shm_log: Path) -> None:
    for entry in segments_made(shm_log):
        for name in entry["segments"]:
            (SHM / name).unlink(missing_ok=True)


def wait_for_first_metrics(process: subprocess.Popen, out: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    metrics = out / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert process.poll() is None, f"exited with {process.returncode} before its first step:\n{process.stdout.read()}"
        assert time.monotonic() < deadline, "no metrics line in time"
        time.sleep(0.5)


@pytest.mark.engine
@pytest.mark.multiprocess
def test_rank_killed_with_sigkill_then_the_same_command_and_another_run_both_work(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")
    crashed = tmp_path / "crashed"
    crashed_log = tmp_path / "crashed-ranks.jsonl"  # not shm-*: the finished runs' logs are checked below
    first = launch(crashed, shm_log=crashed_log)
    try:
        # Killed once its engines are up (its step-0 evaluation is logged): each rank has logged
        # its engine's group with its pid.
        wait_for_first_metrics(first, crashed)
        ranks = {entry["rank"]: entry["pid"] for entry in segments_made(crashed_log)}
        assert sorted(ranks) == [0, 1] and len(set(ranks.values())) == 2, segments_made(crashed_log)
        assert all(psutil.pid_exists(pid) for pid in ranks.values()) and os.getpid() not in ranks.values(), ranks
        os.kill(ranks[1], signal.SIGKILL)
        first.wait(timeout=300)
        assert first.returncode != 0
    except BaseException:
        remove_segments_of(crashed_log)
        raise
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()

    # A dead run's segments under the old shared name and under ours: on an AVX-512 CPU the first
    # is exactly what blocked every later run.
    planted = [SHM / "-tp:0-[0-1]-cpushm_0", SHM / "megatron-rl-1-dead-tp:0-[0-1]-cpushm_1"]
    old = time.time() - 3600
    # Any run on this host that starts a colocated engine removes stale segments, and a test on
    # another worker may start one between the planting and this run's engine start: then the
    # segments are gone but named in that run's output, not in ours. The claim (this run removes
    # and names them) is then checked again on a run of its own, planted anew.
    said, attempts = "", 0
    try:
        while True:
            attempts += 1
            for path in planted:
                path.write_bytes(b"\0" * 4096)
                os.utime(path, (old, old))
            if attempts == 1:  # the same command, and a second run beside it
                runs = [launch(crashed, shm_log=tmp_path / "shm-rerun.jsonl"),
                        launch(tmp_path / "other", shm_log=tmp_path / "shm-other.jsonl")]
            else:
                runs = [launch(tmp_path / f"again-{attempts}", shm_log=tmp_path / f"shm-again-{attempts}.jsonl")]
            outputs = [run.communicate(timeout=900)[0] for run in runs]
            for run, output in zip(runs, outputs):
                assert run.returncode == 0, output[-5000:]
            said = "".join(outputs)
            if all(path.name in said for path in planted) or attempts == 3:
                break
            assert not any(path.exists() for path in planted), f"a run left stale segments in place:\n{said[-3000:]}"
    finally:
        for path in planted:
            path.unlink(missing_ok=True)
        remove_segments_of(crashed_log)  # the killed run's, if the runs after it left them (younger than a stale one)
    assert "stale vLLM shared-memory segment(s)" in said, said[-3000:]
    for path in planted:
        assert path.name in said, f"after {attempts} run(s) of our own:\n{said[-3000:]}"
    # Every finished run made its engine's segments (vLLM's ops on an AVX-512 CPU, the hook's
    # stand-ins on AVX2), on each of its 2 ranks, and none is left.
    logs = sorted(tmp_path.glob("shm-*.jsonl"))
    assert len(logs) == 1 + attempts, logs
    for log in logs:
        made = segments_made(log)
        assert len(made) == 2 and {entry["rank"] for entry in made} == {0, 1}, (log.name, made)
        assert made[0]["group"].startswith("megatron-rl-") and made[0]["group"] == made[1]["group"], made
        names = made[0]["segments"]
        assert len(names) == 2 and all(name.startswith(made[0]["group"]) for name in names), made
        assert not [name for name in names if (SHM / name).exists()], \
            f"a finished run left its segments ({made[0]['ops']} ops): {names}"
