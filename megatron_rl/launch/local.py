"""`megatron-rl launch local`: the same training job on this machine, under torchrun.

    megatron-rl launch local --nproc-per-node 2 [--config FILE] [--output-dir DIR] [key=value ...]

The layout is checked against the world size first (milliseconds), then torchrun starts
`megatron-rl train` with the same arguments on this node.

Signals: a stop signal (SIGTERM, SIGUSR1) sent to this process, to its process group (a terminal,
`kill -TERM -PGID`) or to every process of the job (systemd's cgroup) is the trainer's graceful stop:
the ranks checkpoint and exit 0, and so does this command. torchrun would turn it into a failure
(SIGTERM: it stops the ranks itself, SIGKILL after 30 s, and exits 1; SIGUSR1 kills it), so it runs
in its own session with the stop signals blocked (train/stop_signals.py), and this process passes
each stop signal it gets on to the ranks, also to ranks that start after it arrived. Ctrl-C and a
closed terminal still abort: SIGINT and SIGHUP go to torchrun, which stops the ranks.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys

import psutil

from megatron_rl.errors import ConfigError
from megatron_rl.runtime import torchrun
from megatron_rl.launch.slurm import resolve_config
from megatron_rl.runtime.launch_env import free_port
from megatron_rl.train.stop_signals import StopSignals, block_stop_signals

POLL_S = 0.2  # how soon a stop signal, or a rank started after it, is passed on
ABORT_SIGNALS = (signal.SIGINT, signal.SIGHUP)  # torchrun's own session no longer gets them


def torchrun_command(nproc_per_node: int, train_args: list[str], python: str | None = None,
                     port: int | None = None) -> list[str]:
    """torchrun on this host, its rendezvous store on loopback only (runtime/torchrun.py)."""
    return torchrun.command(python or sys.executable, "--master-addr=127.0.0.1",
                            f"--master-port={port or free_port()}", f"--nproc-per-node={nproc_per_node}",
                            "-m", "megatron_rl.cli", "train", *train_args)


def run_local(config_path: str | None, overrides: list[str], nproc_per_node: int, *, dry_run: bool = False) -> int:
    if nproc_per_node < 1:  # before the layout checks, which divide by it
        raise ConfigError(f"--nproc-per-node must be >= 1 (trainer processes on this machine), got {nproc_per_node}")
    resolve_config(config_path, overrides, nproc_per_node, disaggregated=False)
    train_args = (["--config", config_path] if config_path else []) + list(overrides)
    command = torchrun_command(nproc_per_node, train_args)
    if dry_run:
        print(shlex.join(command))  # as a shell takes it back: a path with a space or '#' stays one argument
        return 0
    print(f"[megatron-rl] {shlex.join(command)}", flush=True)
    return run_torchrun(command)


def run_torchrun(command: list[str]) -> int:
    """torchrun's exit code; the stop signals this process gets reach its ranks (module docstring)."""
    received: list[int] = []
    # Noted from before torchrun starts: its ranks get them once they exist.
    previous = {number: signal.signal(number, lambda number, frame: received.append(number))
                for number in StopSignals.SIGNALS}
    try:
        process = subprocess.Popen(command, env=dict(os.environ), start_new_session=True,
                                   preexec_fn=block_stop_signals)
        for number in ABORT_SIGNALS:
            previous[number] = signal.signal(number, lambda number, frame: _send(process, number))
        return wait_passing_on(process, received)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def wait_passing_on(process: subprocess.Popen, received: list[int]) -> int:
    """Waits for torchrun, sending every signal in `received` (filled by the handlers) once to each
    of its ranks: a rank holds it until its own handler is installed."""
    sent: set[tuple[int, int]] = set()  # (rank pid, signal)
    while True:
        try:
            return process.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        for number in set(received):
            for rank in _ranks(process):
                if (rank.pid, number) not in sent:
                    sent.add((rank.pid, number))
                    _send(rank, number)


def _ranks(process: subprocess.Popen) -> list[psutil.Process]:
    """torchrun's children: the trainer ranks (its rendezvous store is a thread, not a process)."""
    try:
        return psutil.Process(process.pid).children()
    except psutil.NoSuchProcess:
        return []


def _send(process, number: int) -> None:
    try:
        process.send_signal(number)
    except (ProcessLookupError, psutil.NoSuchProcess):
        pass  # already gone
