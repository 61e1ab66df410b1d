"""The console of a default run shows our progress lines, not dependencies' warnings; --verbose
brings them back (megatron_rl/observability/console.py). Real runs: vLLM engine, Megatron-Core, torch."""

import os
import re
import subprocess

import pytest

from _support.processes import REPO, cli_command

pytestmark = pytest.mark.engine

# What the dependencies printed before the console was quieted (Triton, c10's NUMA notice, vLLM's
# FutureWarnings, Megatron-Core's Apex and RerunStateMachine lines, torch UserWarnings).
NOISE = re.compile(r"Warning|WARNING|Triton|NUMA|RerunStateMachine|Apex|deprecated", re.IGNORECASE)


def _run(args, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "TORCH_CPP_LOG_LEVEL", "PYTHONWARNINGS")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="2")
    result = subprocess.run(cli_command(*args), env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-5000:]
    return result.stdout + result.stderr


def test_default_train_run_prints_no_dependency_warnings(tmp_path):
    # The default's every phase (warm start, evaluation, RL step, checkpoint, export), each short:
    # fewer prompts change how much it generates, not what prints.
    output = _run(["train", "--output-dir", str(tmp_path / "run"), "warm_start.steps=2", "rl.steps=1",
                   "rl.eval_every=0", "checkpoint.every_steps=0", "rl.prompts_per_step=8", "data.num_heldout=16"],
                  tmp_path)
    assert "step 1/1" in output and "warm start 1/2" in output
    noise = [line for line in output.splitlines() if NOISE.search(line)]
    assert not noise, "\n".join(noise[:20])


def test_verbose_shows_dependency_warnings(tmp_path):
    output = _run(["smoke", "--steps", "1", "--output-dir", str(tmp_path / "run"), "--verbose"], tmp_path)
    assert "step 1/1" in output
    assert any(NOISE.search(line) for line in output.splitlines()), output[-3000:]
