"""The update guard's decisions on the policy's step results (train/update_guard.py), in process:
exploding weights stop the run against the last good update, naming the phase's learning-rate key;
normal training does not trip it. The policy's own reports (skipped updates, the weight norm) are
checked on a real model in tests/model/test_policy_cpu.py, the whole path through `megatron-rl
train` in test_training_faults.py."""

from __future__ import annotations

import math

import pytest

from megatron_rl.errors import TrainingStopped
from megatron_rl.model.policy import StepResult
from megatron_rl.train.update_guard import WARM_START, UpdateGuard

# The largest change of the weight norm one update made in the tiny default (250 warm-start updates
# at warm_start.lr=3e-3 from a random init, then RL at optimizer.lr=5e-4): x1.0073, warm-start
# update 19; RL's were under x1.0002.
NORMAL_GROWTH = 1.0073


def updated(norm: float, lr: float = 5e-4) -> StepResult:
    return StepResult(loss=0.0, grad_norm=1.0, updated=True, weights_finite=math.isfinite(norm), weight_norm=norm,
                      lr=lr)


def skipped() -> StepResult:
    return StepResult(loss=0.0, grad_norm=float("nan"), updated=False)


def guard(norm: float = 22.8, **kwargs) -> tuple[UpdateGuard, list[str]]:
    lines: list[str] = []
    return UpdateGuard(3, notify=lines.append, weight_norm=norm, max_norm_growth=2.0, **kwargs), lines


def test_normal_training_passes_for_a_long_run():
    check, lines = guard()
    norm = 22.8
    for step in range(1, 1001):  # a thousand updates at the tiny default's largest growth: x1500 in all
        norm *= NORMAL_GROWTH
        check.check(step, 0, updated(norm))
    assert lines == [] and check.last_norm == pytest.approx(norm)


def test_an_update_that_blows_the_weights_up_stops_the_run_naming_the_learning_rate():
    check, _ = guard()
    check.check(1, 0, updated(23.0))
    with pytest.raises(TrainingStopped) as stopped:
        check.check(1, 1, updated(23.0 * 29, lr=1.0))  # still finite
    message = str(stopped.value)
    assert message.startswith("step 1, update 2: the weights are exploding: this update multiplied the policy's "
                              "weight norm by 29 (23 -> 667)"), message
    assert "rl.max_weight_norm_growth=2" in message and "optimizer.lr=1 is too high" in message
    assert "Nothing was saved or pushed from these weights" in message
    assert "re-running resumes from the last checkpoint; with another rate, add checkpoint.allow_config_change=true" \
        in message


def test_in_the_warm_start_it_names_the_warm_start_rate():
    check, _ = guard(phase=WARM_START)
    with pytest.raises(TrainingStopped, match=r"^warm start step 1, update 1: the weights are exploding") as stopped:
        check.check(1, 0, updated(22.8 * 50, lr=1.0))  # the very first update is measured against the start
    assert "warm_start.lr=1 is too high" in str(stopped.value) and "optimizer.lr" not in str(stopped.value)
    assert "the warm start runs before any checkpoint, so a re-run starts over" in str(stopped.value)
    check, _ = guard(phase=WARM_START)
    with pytest.raises(TrainingStopped, match=r"^warm start step 2, update 1: the update made the policy's weights "
                                              r"non-finite .* Lower warm_start.lr \(0.003 at this update"):
        check.check(2, 0, updated(float("inf"), lr=3e-3))


def test_growth_is_measured_against_the_last_good_update():
    check, lines = guard()
    check.check(1, 0, updated(40.0))  # x1.75 from the start: allowed
    check.check(2, 0, skipped())  # the weights did not change
    assert lines == ["step 2, update 1: non-finite gradient, update skipped (1 in a row; the run stops at "
                     "rl.max_bad_steps=3)"]
    check.check(3, 0, updated(79.0))  # x1.975 from step 1's
    with pytest.raises(TrainingStopped, match=r"by 2.03 \(79 -> 160\)"):
        check.check(4, 0, updated(160.0))


def test_zero_turns_the_growth_check_off():
    check = UpdateGuard(3, notify=print, weight_norm=1.0, max_norm_growth=0)
    check.check(1, 0, updated(1e12))
    with pytest.raises(TrainingStopped, match="non-finite"):
        check.check(2, 0, updated(float("nan")))
