"""The RL loop end to end with the real parts: Megatron-Core policy, vLLM (CPU build) rollouts,
the built-in synthetic task, checkpoints on disk, run through the `megatron-rl train` CLI.

- exact resume: a run stopped by SIGTERM and resumed logs the same metrics (every key except
  wall-clock times) for the steps after its checkpoint as an uninterrupted run, bit for bit;
- a reward function that raises or hangs scores 0 for those samples, is counted, and the run
  completes;
- MoE routing replay and the routing-drift metric with several updates per rollout;
- a misspelled key or an impossible layout fails in under a second, naming the key.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")

from megatron_rl.logging import WALL_CLOCK  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# Small enough for CI: 30 warm-start steps, then 5 RL steps of 8 prompts x 4 samples.
SHORT = ["rl.steps=5", "rl.prompts_per_step=8", "rl.group_size=4", "rl.max_response_tokens=6",
         "warm_start.steps=30", "data.num_heldout=16", "rl.eval_every=2", "checkpoint.every_steps=2",
         "logging.wandb_mode=disabled"]


def command(out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "megatron_rl.cli", "train", "--output-dir", str(out), *SHORT, *overrides]


def environment() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def run(out: Path, *overrides: str, config: Path | None = None) -> subprocess.CompletedProcess:
    cmd = command(out, *overrides) + (["--config", str(config)] if config else [])
    result = subprocess.run(cmd, env=environment(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def metrics(out: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {r["step"]: r for r in records}


def comparable(record: dict) -> dict:
    """Everything but wall-clock keys: phase times and each row's timestamp and elapsed run time."""
    return {k: v for k, v in record.items() if not k.startswith("time/") and k not in WALL_CLOCK}


def test_exact_resume_after_sigterm(tmp_path):
    whole = tmp_path / "whole"
    run(whole)
    reference = metrics(whole)
    assert max(reference) == 5 and "eval/accuracy" in reference[0] and "eval/accuracy" in reference[5]

    interrupted = tmp_path / "interrupted"
    process = subprocess.Popen(command(interrupted), env=environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        path = interrupted / "metrics.jsonl"
        if path.is_file() and any(json.loads(line)["step"] >= 2 for line in path.read_text().splitlines() if line):
            process.send_signal(signal.SIGTERM)
            break
        time.sleep(0.2)
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-4000:]
    state = json.loads((interrupted / "run_state.json").read_text())
    assert state["finished"] is False, state
    stopped_at = state["step"]
    assert 2 <= stopped_at < 5, state
    assert f"stopped by SIGTERM after step {stopped_at}" in output

    resumed = run(interrupted)
    assert f"resumed from" in resumed.stdout
    after = metrics(interrupted)
    assert sorted(after) == sorted(reference)
    for step in range(stopped_at + 1, 6):
        assert comparable(after[step]) == comparable(reference[step]), f"step {step} differs after resume"
        assert "reward/mean" in comparable(after[step]) and "train/loss" in comparable(after[step])
    # Run time continues across the resume: never decreasing down the file.
    elapsed = [after[step]["elapsed_s"] for step in sorted(after)]
    assert elapsed == sorted(elapsed) and elapsed[stopped_at + 1] > elapsed[stopped_at], elapsed
    # The steps before the checkpoint were not re-run: their records are the interrupted run's own.
    assert json.loads((interrupted / "run_state.json").read_text()) == {"step": 5, "finished": True}


def test_failing_reward_function_is_counted_and_run_completes(tmp_path):
    config = tmp_path / "flaky.yaml"
    config.write_text(
        "rewards:\n"
        "  timeout_s: 1.0\n"
        "  terms:\n"
        f"    - name: {REPO / 'tests' / 'trainer' / 'flaky_rewards.py'}:raises_on_sevens\n"
    )
    out = tmp_path / "run"
    run(out, "rl.steps=3", "checkpoint.every_steps=0", config=config)
    records = metrics(out)
    errors = sum(r.get("reward/errors", 0) for r in records.values() if r["step"] > 0)
    timeouts = sum(r.get("reward/timeouts", 0) for r in records.values() if r["step"] > 0)
    assert errors > 0, "no sample made the reward function raise; the test would not show anything"
    assert timeouts > 0, "no sample made the reward function hang"
    assert json.loads((out / "run_state.json").read_text())["finished"] is True


def test_routing_replay_and_drift_metric(tmp_path):
    out = tmp_path / "replay"
    run(out, "rl.steps=2", "rl.updates_per_rollout=2", "rl.routing_replay=true", "checkpoint.every_steps=0",
        "rl.eval_every=0")
    records = metrics(out)
    for step in (1, 2):
        drift = records[step]["moe/routing_drift"]
        assert 0.0 <= drift <= 1.0
        assert records[step]["train/updates"] == 2
        # With two updates the second one sees a changed policy: the ratio departs from 1.
        assert "actor/ratio_max" in records[step]


@pytest.mark.parametrize("override,expected", [
    ("rl.stepz=3", "unknown key 'rl.stepz'; did you mean 'steps'?"),
    ("parallel.tp=3", "num_attention_heads=4 is not divisible by parallel.tp=3"),
    ("parallel.ep=3", "parallel.ep=3 must divide the number of experts (4)"),
])
def test_bad_config_fails_in_under_a_second(tmp_path, override, expected):
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", "--output-dir", str(tmp_path), override],
                            env=environment(), capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - started
    assert result.returncode == 2
    assert expected in result.stderr, result.stderr
    assert elapsed < 1.0, f"took {elapsed:.2f}s"
    assert not any(tmp_path.iterdir()), "a failed config check must not write anything"
