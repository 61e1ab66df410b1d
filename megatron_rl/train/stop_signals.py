"""A graceful stop: SLURM sends SIGUSR1 (sbatch --signal) or SIGTERM before preemption or the time
limit; the trainer finishes the step, checkpoints and exits, and the same command resumes.

The signal may come to the trainer alone, to its process group, or to every process of the job
(SLURM's process tracking, systemd's cgroup): launchers and helpers must not turn it into a failure.
`megatron-rl launch local` starts torchrun with the stop signals blocked (`block_stop_signals`):
torchrun never takes them, and its ranks inherit the block, so a signal that arrives while a rank
starts up waits, pending, until `StopSignals.install` unblocks it and the rank stops after its
next step."""

from __future__ import annotations

import signal


class StopSignals:
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received: str | None = None

    def install(self) -> None:
        for number in self.SIGNALS:
            signal.signal(number, self._note)
        # Only after the handler is in place: a signal held back by a launcher's block arrives now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.SIGNALS)

    def _note(self, number, frame) -> None:
        self.received = signal.Signals(number).name

    def requested(self, runtime) -> str | None:
        """Collective: the signal that stops the run after this step, if any rank got one (all
        ranks stop together)."""
        if runtime.any_rank(self.received is not None):
            return self.received or "a signal on another rank"
        return None


def block_stop_signals() -> None:
    """A launcher's `preexec_fn` for torchrun: the stop signals blocked there and, inherited through
    fork and exec, in the ranks until they install their handler. torchrun would otherwise act on
    them itself: SIGTERM makes it stop the ranks (SIGKILL after 30 s) and exit 1, SIGUSR1 kills it.
    The cost: while a rank starts up, torchrun's own SIGTERM (after another rank failed) also waits,
    so torchrun kills it after its 30 s grace instead."""
    signal.pthread_sigmask(signal.SIG_BLOCK, StopSignals.SIGNALS)
