"""Diverged updates: counted, logged, and never allowed into a checkpoint or an engine.

Policy.optimizer_step skips an update whose gradient holds a NaN or an infinity (on any rank) and
reports, for a completed update, the norm of the weights it left (Policy.weight_norm). This guard
turns those results into the run's decisions:

    skipped update            counted (train/skipped_updates), one console line; the weights are
                              the previous step's, so the run goes on
    rl.max_bad_steps in a row TrainingStopped: the cause is not transient (a broken reward scale,
                              a learning rate that diverged); no checkpoint is written at this step
    non-finite weights        TrainingStopped at once: the update cannot be undone, and the next
                              forward would train on NaN; no checkpoint, no weight push
    exploding weights         TrainingStopped at once, the same way: one update multiplied the
                              weight norm by more than rl.max_weight_norm_growth, against the last
                              good update's (or, for the first, the weights the guard started
                              from). Finite weights of 1e14 are no better than NaN: checkpointed,
                              every resume would die at its next step

It raises before Trainer.rl_step returns, so the step's checkpoint (written after it) and weight
push never see the bad weights: the checkpoint a re-run resumes from is the last good one.

The messages name the setting that most likely caused it: the learning rate of the phase the
update ran in (`optimizer.lr` in RL, `warm_start.lr` in the warm start). A weight decay large
enough to blow the weights up by itself (lr x weight_decay >= 1) is refused by the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatron_rl.errors import TrainingStopped


@dataclass(frozen=True)
class Phase:
    """Where the guarded updates run: how messages name a step, and the key of their learning rate."""

    step_label: str = "step"
    lr_key: str = "optimizer.lr"
    # How a re-run with a lower rate goes on.
    rerun: str = ("re-running resumes from the last checkpoint; with another rate, add "
                  "checkpoint.allow_config_change=true (or start over with checkpoint.resume=none)")


RL = Phase()
WARM_START = Phase("warm start step", "warm_start.lr",
                   "the warm start runs before any checkpoint, so a re-run starts over")


class UpdateGuard:
    def __init__(self, max_bad_steps: int, notify: Callable[[str], None], *, weight_norm: float,
                 max_norm_growth: float, phase: Phase = RL):
        """`weight_norm`: Policy.weight_norm() of the weights before the first guarded update;
        `max_norm_growth`: rl.max_weight_norm_growth (0: no check)."""
        self.max_bad_steps = max_bad_steps
        self.notify = notify
        self.max_norm_growth = max_norm_growth
        self.phase = phase
        self.in_a_row = 0
        self.last_norm = weight_norm  # after the last good update

    def check(self, step: int, update: int, result) -> None:
        """`result`: the StepResult of update `update` (0-based) of step `step`."""
        where = f"{self.phase.step_label} {step}, update {update + 1}"
        if result.updated and not result.weights_finite:
            raise TrainingStopped(
                f"{where}: the update made the policy's weights non-finite (a NaN, an infinity, or a weight norm "
                f"beyond float32; gradient norm before clipping {result.grad_norm:.4g}). Nothing was saved or pushed "
                f"from these weights. Lower {self.phase.lr_key} ({result.lr:.4g} at this update) or check the rewards' "
                f"scale first; {self.phase.rerun}.")
        if result.updated:
            self._check_growth(where, result)
            self.in_a_row = 0
            self.last_norm = result.weight_norm
            return
        self.in_a_row += 1
        if self.in_a_row >= self.max_bad_steps:
            raise TrainingStopped(
                f"{self.phase.step_label} {step}: {self.in_a_row} updates in a row were skipped for a non-finite "
                f"gradient (rl.max_bad_steps={self.max_bad_steps}); the weights are those of the last good update and "
                f"no checkpoint was written at this step. Re-running the same command resumes from the last "
                f"checkpoint; look for what makes the loss NaN (rewards, advantages, a learning rate too high).")
        self.notify(f"{where}: non-finite gradient, update skipped "
                    f"({self.in_a_row} in a row; the run stops at rl.max_bad_steps={self.max_bad_steps})")

    def _check_growth(self, where: str, result) -> None:
        if not self.max_norm_growth or self.last_norm <= 0:
            return
        growth = result.weight_norm / self.last_norm
        if growth <= self.max_norm_growth:
            return
        raise TrainingStopped(
            f"{where}: the weights are exploding: this update multiplied the policy's weight norm by {growth:.3g} "
            f"({self.last_norm:.4g} -> {result.weight_norm:.4g}), more than rl.max_weight_norm_growth="
            f"{self.max_norm_growth:g} allows (a normal update changes it by well under 1%). Nothing was saved or "
            f"pushed from these weights. The likely cause: {self.phase.lr_key}={result.lr:.4g} is too high for this "
            f"model (Adam moves every weight by about lr per update); lower it: {self.phase.rerun}.")
