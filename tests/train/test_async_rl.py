"""Asynchronous RL end to end (rl.max_staleness=1) with a real vLLM CPU server beside the trainer.

One server (tests/conftest.py, shared) serves three runs of `megatron-rl train` in turn, each
pushing its own weights first:

- an uninterrupted run: every step logs rollout/staleness_mean and _max, never above 1, and 1
  on the steps after the first (the engines generated them while the trainer trained on the
  previous batch); the loss reports the trainer-engine mismatch per staleness;
- the same run stopped by SIGTERM (samples of the next step already generated, the one after
  in flight) and resumed: the steps after its checkpoint log exactly the uninterrupted run's
  metrics, because the checkpoint carries the finished batch and where the next one starts.

All three runs are forked from the tests' pre-imported server (the stopped one's client passes
the SIGTERM on); test_train_loop.py's exact-resume test stops a fresh process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")

from run_records import comparable, metrics  # noqa: E402
from test_train_loop import run, stop_with_sigterm  # noqa: E402

pytestmark = pytest.mark.engine


def asynchronous(url: str, staging: Path) -> list[str]:
    return ["rollout.mode=server", f"rollout.server_urls=[{url}]", "rollout.weight_transport=files",
            f"rollout.staging_dir={staging}", "rl.max_staleness=1"]


def test_staleness_one_runs_off_policy_and_resumes_exactly(tiny_vllm_server, tmp_path):
    overrides = asynchronous(tiny_vllm_server[0], tmp_path / "staging")
    whole = tmp_path / "whole"
    run(whole, *overrides)
    reference = metrics(whole)
    assert max(reference) == 5
    for step in range(1, 6):
        record = reference[step]
        assert record["rollout/staleness_max"] == (0 if step == 1 else 1), (step, record["rollout/staleness_max"])
        assert record["rollout/staleness_mean"] == (0.0 if step == 1 else 1.0)
        assert record["mismatch/staleness_1/tokens"] == (0 if step == 1 else record["count/tokens"])
        assert "tis/weight_mean" in record
    # At staleness 0 the engine computed what the trainer computes; stale samples come from
    # another policy, which the importance weight corrects for.
    assert reference[1]["mismatch/staleness_0/logp_abs_diff_mean"] < 1e-4
    assert min(reference[step]["mismatch/staleness_1/logp_abs_diff_mean"] for step in range(2, 6)) > 1e-3

    interrupted = tmp_path / "interrupted"
    output = stop_with_sigterm(interrupted, *overrides, after_step=1, preloaded=True)
    stopped_at = json.loads((interrupted / "run_state.json").read_text())["step"]
    assert 1 <= stopped_at < 5, output[-2000:]  # room for a late signal: stop_with_sigterm

    resumed = run(interrupted, *overrides)
    assert "resumed from" in resumed.stdout
    after = metrics(interrupted)
    for step in range(stopped_at + 1, 6):
        assert comparable(after[step]) == comparable(reference[step]), f"step {step} differs after resume"
