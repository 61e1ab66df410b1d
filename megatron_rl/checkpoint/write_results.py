"""The queue Megatron-Core's checkpoint file writers report to, started by the trainer itself."""

from __future__ import annotations

import ctypes
import multiprocessing
import signal


def start_write_results_queue() -> None:
    """Megatron-Core's file writers report to a queue served by a multiprocessing Manager process
    that it spawns on first use. Two problems for a trainer: spawning it took ~2.5 s, which made
    the first asynchronous save late; and a spawned process keeps the default signal handling,
    while SLURM's preemption warning (USR1) and SIGTERM reach every process of the job: the
    Manager died of the USR1 while the stop checkpoint was being written, and that save failed.
    So the trainer starts it at start-up, forked (milliseconds), ignoring the stop signals (the
    trainer handles them) and set to die with its parent. Idempotent; per process."""
    import megatron.core  # noqa: F401  (the strategies module alone hits an import cycle)
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    from multiprocessing.managers import SyncManager

    manager = SyncManager(ctx=multiprocessing.get_context("fork"))
    manager.start(initializer=_serve_write_results)
    # The queue's proxy holds the manager, which shuts its process down when the trainer exits.
    filesystem_async._results_queue = manager.Queue()


def _serve_write_results() -> None:
    """Initializer of the results-queue process (see start_write_results_queue)."""
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, signal.SIG_IGN)
    try:  # killed with the trainer even when the trainer cannot shut it down (SIGKILL)
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
