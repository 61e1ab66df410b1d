"""A stop signal during `train`'s supervised warm start ends it after the step in flight.

Before, the trainer looked at SIGTERM/SIGUSR1 only after each RL step: a signal in the warm start
waited for the rest of it, step 0's evaluation and RL step 1 (38 s on the tiny default's 250
steps, 430 s on tiny_agent's; SLURM kills a job about 30 s after its SIGTERM). Now the warm start
asks after each of its steps (collectively, as the RL loop does) and raises WarmStartStopped,
which Trainer.run turns into a clean exit 0 with nothing saved (a part of a warm start is no
state a checkpoint resumes exactly; the same command starts over).

The real tiny policy on one gloo rank in a subprocess (warm_start_worker.py), signalled by itself.
"""

import json
from pathlib import Path

import pytest

from _support.processes import child_env, python_command

pytestmark = pytest.mark.subprocess  # runs a child process (pyproject's marks; scripts/test.sh --quick)

WORKER = Path(__file__).with_name("warm_start_worker.py")


def test_sigterm_in_the_warm_start_stops_it_after_the_step_in_flight(tmp_path):
    import subprocess

    out = tmp_path / "result.json"
    result = subprocess.run(python_command(WORKER, tmp_path / "run", out, preloaded=True),
                            env=child_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-5000:]
    seen = json.loads(out.read_text())
    assert seen["trained"] == [1, 2, 3], seen  # the step the signal came in finished; no step after it
    assert seen["stopped"] == {"signal": "SIGTERM", "step": 3, "total": 40,
                               "text": "stopped by SIGTERM in the warm start, after its step 3 of 40"}, seen
