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
from megatron_rl.train.run_lock import LOCK, Holder, acquire, this_process


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
