"""Faults inside a training run, on the real trainer with vLLM rollouts: what stops the run, what
it prints, and what is kept on disk (docs/faults.md).

- non-finite updates: skipped and counted; rl.max_bad_steps in a row stop the run before that
  step's checkpoint; an update that makes the weights explode stops it at once; the re-run
  resumes from the last good checkpoint.
- a reward function failing on every sample stops the run at its first step, with its error; so
  does a multi-turn environment failing on every trajectory.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from _support.processes import REPO, child_env, python_command

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")

pytestmark = pytest.mark.engine

HERE = Path(__file__).parent
# No warm start (nothing here depends on what the policy knows): each run is mostly start-up.
SHORT = ["rl.steps=4", "rl.prompts_per_step=4", "rl.group_size=4", "rl.max_response_tokens=4",
         "warm_start.steps=0", "data.num_heldout=4", "rl.eval_every=0", "checkpoint.every_steps=1",
         "checkpoint.keep_last=3", "logging.wandb_mode=disabled"]


def train_with(out: Path, *faults: str, overrides=(), config: Path | None = None) -> subprocess.CompletedProcess:
    """`megatron-rl train` with `faults` injected (injected_divergence.py)."""
    env = child_env(PYTHONPATH=f"{REPO}{os.pathsep}{HERE}")
    command = python_command(HERE / "injected_divergence.py", *faults, "--", "train",
                             *(["--config", str(config)] if config else []), "--output-dir", out, *SHORT, *overrides,
                             preloaded=True)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)


def saved_steps(out: Path) -> list[str]:
    return sorted(path.name for path in (out / "checkpoints").glob("step_*"))


def latest(out: Path) -> str:
    return (out / "checkpoints" / "latest").read_text().strip() if (out / "checkpoints" / "latest").is_file() \
        else os.readlink(out / "checkpoints" / "latest")


def logged_steps(out: Path) -> dict[int, dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, lines)}


def test_injected_nan_gradients_are_skipped_then_stop_and_exploding_weights_are_never_saved(tmp_path):
    out = tmp_path / "run"
    # NaN gradients from step 2 on, two updates per step: step 2's two updates are skipped (the
    # run goes on), step 3's first makes three in a row. GRPO keeps every group (no dynamic
    # sampling), so both updates of every step have data and run (an update without any is not
    # taken: tests/train/test_empty_updates.py).
    first = train_with(out, "nan_from=2", overrides=["rl.max_bad_steps=3", "rl.updates_per_rollout=2", "rl.recipe=grpo"])
    assert first.returncode == 1, first.stderr[-4000:]
    assert "3 updates in a row were skipped for a non-finite gradient (rl.max_bad_steps=3)" in first.stderr, \
        first.stderr[-3000:]
    assert "step 2, update 1: non-finite gradient, update skipped (1 in a row" in first.stdout + first.stderr
    assert "Traceback" not in first.stderr, first.stderr[-3000:]
    assert saved_steps(out) == ["step_000001", "step_000002"]  # nothing written at step 3
    assert latest(out).endswith("step_000002")
    records = logged_steps(out)
    assert records[2]["train/skipped_updates"] == 2 and records[1]["train/skipped_updates"] == 0
    assert 3 not in records

    # The re-run resumes from step 2; its step 3 makes the weights explode, finite (learning rate
    # 1): stopped at once, unsaved. (Non-finite weights stop it the same way: update_guard.py,
    # tests/train/test_update_guard.py.) It used to save them as `latest`, and every resume died.
    second = train_with(out, "explode_at=3", overrides=["rl.recipe=grpo"])
    assert second.returncode == 1, second.stderr[-4000:]
    assert "resumed from" in second.stdout + second.stderr and "step_000002" in second.stdout + second.stderr
    assert "step 3, update 1: the weights are exploding: this update multiplied the policy's weight norm by" \
        in second.stderr, second.stderr[-3000:]
    assert "optimizer.lr=1 is too high" in second.stderr and "Traceback" not in second.stderr
    assert saved_steps(out) == ["step_000001", "step_000002"]
    assert latest(out).endswith("step_000002")
    assert 3 not in logged_steps(out)


def test_reward_failing_on_every_sample_stops_after_the_first_step_with_its_error(tmp_path):
    """It used to exit 0 after training on all-zero rewards, `reward/errors` in metrics.jsonl the
    only trace."""
    config = tmp_path / "broken_reward.yaml"
    config.write_text("rewards:\n  terms:\n"
                      f"    - name: {HERE / 'flaky_rewards.py'}:always_raises\n")
    out = tmp_path / "run"
    result = train_with(out, overrides=["rl.max_refill_rounds=0"], config=config)
    assert result.returncode == 1, result.stderr[-4000:]
    assert "step 1: all 16 reward calls failed (16 raised, 0 timed out)" in result.stderr, result.stderr[-3000:]
    assert "KeyError: 'answer_field'" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert 1 not in logged_steps(out) and saved_steps(out) == []


def test_environment_failing_on_every_trajectory_stops_after_the_first_step_with_its_error(tmp_path):
    """The reward functions' rule, for multi-turn environments: it used to exit 0 having trained on
    nothing (every group dropped), `agent/failed` in metrics.jsonl the only trace."""
    out = tmp_path / "run"
    result = train_with(out, overrides=["rl.max_refill_rounds=0", "data.prompt_format=chat",
                                        "rollout.environment=failing_environment:MissingField"])
    assert result.returncode == 1, result.stderr[-4000:]
    assert ("step 1: all 16 trajectories failed in rollout.environment=failing_environment:MissingField; first: "
            "group 0, trajectory 0: reset() raised KeyError: 'expected_tool_output' (at "
            f"{HERE / 'failing_environment.py'}:9)") in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert 1 not in logged_steps(out) and saved_steps(out) == []

