"""A graceful stop: SLURM sends SIGUSR1 (sbatch --signal) or SIGTERM before preemption or the time
limit; the trainer finishes the step, checkpoints and exits, and the same command resumes."""

from __future__ import annotations

import signal


class StopSignals:
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received: str | None = None

    def install(self) -> None:
        for number in self.SIGNALS:
            signal.signal(number, self._note)

    def _note(self, number, frame) -> None:
        self.received = signal.Signals(number).name

    def requested(self, runtime) -> str | None:
        """Collective: the signal that stops the run after this step, if any rank got one (all
        ranks stop together)."""
        if runtime.any_rank(self.received is not None):
            return self.received or "a signal on another rank"
        return None
