"""Non-finite updates: counted, logged, and never allowed into a checkpoint or an engine.

Policy.optimizer_step skips an update whose gradient holds a NaN or an infinity (on any rank) and
reports whether a completed update left every weight finite. This guard turns those results into
the run's decisions:

    skipped update            counted (train/skipped_updates), one console line; the weights are
                              the previous step's, so the run goes on
    rl.max_bad_steps in a row TrainingStopped: the cause is not transient (a broken reward scale,
                              a learning rate that diverged); no checkpoint is written at this step
    non-finite weights        TrainingStopped at once: the update cannot be undone, and the next
                              forward would train on NaN; no checkpoint, no weight push

It raises before Trainer.rl_step returns, so the step's checkpoint (written after it) and weight
push never see the bad weights: the checkpoint a re-run resumes from is the last good one.
"""

from __future__ import annotations

from typing import Callable

from megatron_rl.errors import TrainingStopped


class UpdateGuard:
    def __init__(self, max_bad_steps: int, notify: Callable[[str], None]):
        self.max_bad_steps = max_bad_steps
        self.notify = notify
        self.in_a_row = 0

    def check(self, step: int, update: int, result) -> None:
        """`result`: the StepResult of update `update` (0-based) of RL step `step`."""
        if result.updated and not result.weights_finite:
            raise TrainingStopped(
                f"step {step}, update {update + 1}: the update made the policy's weights non-finite (a NaN, an "
                f"infinity, or a weight norm beyond float32; gradient norm before clipping {result.grad_norm:.4g}). "
                f"Nothing was saved or pushed from these weights; re-running the same command resumes from the "
                f"last checkpoint. Lower optimizer.lr or check the rewards' scale first.")
        if result.updated:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        if self.in_a_row >= self.max_bad_steps:
            raise TrainingStopped(
                f"step {step}: {self.in_a_row} updates in a row were skipped for a non-finite gradient "
                f"(rl.max_bad_steps={self.max_bad_steps}); the weights are those of the last good update and no "
                f"checkpoint was written at this step. Re-running the same command resumes from the last "
                f"checkpoint; look for what makes the loss NaN (rewards, advantages, a learning rate too high).")
        self.notify(f"step {step}, update {update + 1}: non-finite gradient, update skipped "
                    f"({self.in_a_row} in a row; the run stops at rl.max_bad_steps={self.max_bad_steps})")
