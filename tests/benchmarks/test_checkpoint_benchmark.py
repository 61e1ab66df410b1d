"""benchmarks/checkpoint.py --quick must keep working: it saves the trainer's checkpoints both ways,
verifies each and prints the blocked-time ratio. Only that it runs and what it prints are checked,
not the timings."""

import re
import subprocess

import pytest

from _support.processes import REPO, child_env, python_command

pytestmark = pytest.mark.subprocess  # runs a child process (pyproject's marks; scripts/test.sh --quick)


def test_quick_run_saves_both_ways_and_prints_the_ratio():
    env = child_env(OMP_NUM_THREADS="2")
    command = python_command(REPO / "benchmarks" / "checkpoint.py", "--quick", "--saves", "1", preloaded=True, children=True)
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    output = result.stdout
    assert re.search(r"sync  save \d+: blocked \d+\.\d+ s, wrote \d+ MiB", output), output
    assert re.search(r"async save \d+: blocked \d+\.\d+ s", output), output
    assert re.search(r"ratio asynchronous/synchronous blocked time: \d+\.\d+ \(goal <= 0.2: (met|GOAL MISSED)\)", output), output
