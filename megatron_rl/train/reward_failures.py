"""Reward functions that fail: a line per step when some calls fail, a stop when all of them do.

A failing reward call scores 0 and is counted (rewards/scoring.py). That is right for a few
samples (a malformed response, a slow verifier) and wrong when every call fails: the run would
train on all-zero rewards for hours and exit 0, with `reward/errors` in metrics.jsonl the only
trace. The rule, on the step's rollout metrics (the same on every rank) before the step trains:

    some calls failed   one console line: how many of how many, raised / timed out, the first error
    every call failed   TrainingStopped with the first error; nothing was trained on those rewards
"""

from __future__ import annotations

from typing import Callable

from megatron_rl.errors import TrainingStopped


def check_reward_failures(step: int, metrics: dict, first_error: str | None, notify: Callable[[str], None]) -> None:
    """`metrics`: the step's rollout metrics (reward/calls, reward/errors, reward/timeouts);
    `first_error`: the scorer's first failure message (the driver has it; None elsewhere)."""
    errors, timeouts = int(metrics.get("reward/errors", 0)), int(metrics.get("reward/timeouts", 0))
    calls = int(metrics.get("reward/calls", 0))
    failed = errors + timeouts
    if not failed:
        return
    how = f"{errors} raised, {timeouts} timed out"
    first = f"; first: {first_error}" if first_error else ""
    if failed >= calls:
        raise TrainingStopped(f"step {step}: all {calls} reward calls failed ({how}){first}. Nothing was trained on these "
                              f"rewards; fix the reward function (or rewards.timeout_s) and re-run the same command "
                              f"(it resumes from the last checkpoint).")
    notify(f"step {step}: {failed} of {calls} reward calls failed ({how}), each scored 0{first}")
