"""One run per output directory (train/run_lock.py): a live holder refuses a second run by name, a
dead one on this host or the same SLURM job requeued elsewhere is taken over with a line. The lock
logic runs in this process against real processes; one short `megatron-rl train` shows the
trainer refusing before it writes anything. Releasing on a normal end and on SIGTERM, and the
rerun in the same directory, are checked by tests/train/test_train_loop.py's resume test."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from megatron_rl.errors import ConfigError
from megatron_rl.train.run_lock import LOCK, Holder, acquire, holder_of, this_process


def write_lock(directory, holder: Holder) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / LOCK).write_text(json.dumps(dataclasses.asdict(holder)))


def live_elsewhere() -> Holder:
    """Another process on this host that is running: this test's parent."""
    parent = this_process()
    return dataclasses.replace(parent, pid=os.getppid(), pid_start=_start_of(os.getppid()))


def _start_of(pid: int) -> int:
    from megatron_rl.train.run_lock import _process_start

    return _process_start(pid)


def exited_process() -> Holder:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return dataclasses.replace(this_process(), pid=child.pid, pid_start=12345)


def test_a_live_run_is_refused_by_name_and_its_lock_kept(tmp_path):
    holder = live_elsewhere()
    write_lock(tmp_path, holder)
    with pytest.raises(ConfigError) as error:
        acquire(tmp_path, notify=pytest.fail)
    assert f"is in use by another run: pid {holder.pid} on {holder.host}" in str(error.value)
    assert f"If that run is gone (its machine failed), delete {tmp_path / LOCK}" in str(error.value)
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == holder.pid


def test_a_dead_holder_on_this_host_is_taken_over_with_a_line_and_released(tmp_path):
    dead = exited_process()
    write_lock(tmp_path, dead)
    lines = []
    lock = acquire(tmp_path, notify=lines.append)
    assert lines == [f"took over the lock of {dead.describe()} on {tmp_path} (process {dead.pid} is no longer "
                     "running)"]
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    with pytest.raises(ConfigError, match=f"pid {os.getpid()} on"):  # another identity of this host is refused
        acquire(tmp_path, notify=pytest.fail, me=dataclasses.replace(this_process(), pid=os.getppid(),
                                                                     pid_start=_start_of(os.getppid())))
    lock.release()
    assert not (tmp_path / LOCK).exists()


def test_a_reused_pid_does_not_keep_a_dead_runs_lock(tmp_path):
    """The holder's pid now belongs to a younger process (our parent, started at another time)."""
    reused = dataclasses.replace(live_elsewhere(), pid_start=_start_of(os.getppid()) - 1)
    write_lock(tmp_path, reused)
    lines = []
    acquire(tmp_path, notify=lines.append).release()
    assert lines and "is no longer running" in lines[0]


def test_a_requeued_slurm_job_takes_over_and_another_job_is_refused(tmp_path):
    elsewhere = dataclasses.replace(this_process(), host="node-a", boot_id="other", slurm_job_id="77")
    write_lock(tmp_path, elsewhere)
    with pytest.raises(ConfigError, match="pid .* on node-a, SLURM job 77"):
        acquire(tmp_path, notify=pytest.fail, me=dataclasses.replace(this_process(), slurm_job_id="78"))
    lines = []
    acquire(tmp_path, notify=lines.append, me=dataclasses.replace(this_process(), slurm_job_id="77")).release()
    assert lines and "(SLURM job 77 was requeued onto" in lines[0]


def test_a_release_leaves_another_runs_lock_alone(tmp_path):
    lock = acquire(tmp_path, notify=pytest.fail)
    holder = live_elsewhere()
    write_lock(tmp_path, holder)  # someone deleted ours and took it
    lock.release()
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == holder.pid


def test_train_refuses_a_directory_a_live_run_holds_before_reading_or_writing_anything(tmp_path):
    """The trainer's entry (what `megatron-rl train` runs), in this process: a single process
    stops before its preflight, so no runtime is started here."""
    from megatron_rl.config import load_config
    from megatron_rl.train.trainer import train

    out = tmp_path / "run"
    write_lock(out, live_elsewhere())
    with pytest.raises(ConfigError, match=f"output directory {out} is in use by another run: pid {os.getppid()} on"):
        train(load_config(None, [f"output_dir={out}", "data.train=/no/such/file.jsonl"]))
    assert sorted(p.name for p in out.iterdir()) == [LOCK]


def test_a_malformed_lock_is_taken_over_with_a_line_naming_the_file_and_the_key(tmp_path):
    """Content no run wrote whole names no holder: once older than a partial write could be, it is
    taken over, the line naming the file and what is wrong (not a TypeError or OverflowError from
    os.kill, nor a UnicodeDecodeError)."""
    fields = dataclasses.asdict(this_process())
    path = tmp_path / LOCK
    for content, named in ((b"\xff\xfe{", "run.lock is not UTF-8 JSON"),
                           ({**fields, "pid": "abc"}, "run.lock: 'pid' is \"abc\", not an integer"),
                           ({**fields, "pid": 10**21}, "run.lock: 'pid' is 1000000000000000000000, not a process id"),
                           ({**fields, "pid": -1}, "run.lock: 'pid' is -1, not a process id"),
                           ({**fields, "pid": True}, "run.lock: 'pid' is true, not an integer"),
                           ({**fields, "host": None}, "run.lock: 'host' is null, not a string"),
                           ({**fields, "pid_start": 1.5}, "run.lock: 'pid_start' is 1.5, not an integer"),
                           ([1], "run.lock is not the JSON object a run writes"),
                           (b"[" * 100_000, "run.lock is not UTF-8 JSON")):
        path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
        os.utime(path, (0, 0))  # older than a partial write
        lines = []
        acquire(tmp_path, notify=lines.append).release()
        assert len(lines) == 1 and lines[0].startswith(f"took over an unreadable lock on {tmp_path} ({tmp_path}/"
                                                       f"{named}"), (lines, named)
        assert not path.exists()


def test_something_other_than_a_file_in_the_locks_place_is_refused_by_name_without_blocking(tmp_path):
    import threading

    for name, make in (("directory", os.mkdir), ("fifo", os.mkfifo), ("device", lambda p: os.symlink("/dev/zero", p))):
        directory = tmp_path / name
        directory.mkdir()
        make(directory / LOCK)
        outcome = []

        def take():
            for attempt in (lambda: acquire(directory, notify=pytest.fail), lambda: holder_of(directory)):
                try:
                    attempt()
                except ConfigError as exc:
                    outcome.append(str(exc))

        thread = threading.Thread(target=take, daemon=True)
        thread.start()
        thread.join(timeout=10)
        assert not thread.is_alive(), f"blocked on a {name} in the lock's place"
        assert outcome == 2 * [f"{directory / LOCK} is not a file (a directory, FIFO or device is in its place): a "
                               "run lock is a file a run writes; remove it, or pass another --output-dir"], outcome
