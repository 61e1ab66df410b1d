"""benchmarks/step_overhead.py --quick must keep working: it builds our policy and the same model in
transformers, checks they compute the same old logprobs and first-update loss, and prints the
ratios and the profile breakdown. Only that it runs and what it prints are checked here, not the timings."""

import os
import re
import subprocess

import pytest

from _support.processes import REPO, child_env, python_command

pytestmark = pytest.mark.subprocess  # runs a child process (pyproject's marks; scripts/test.sh --quick)

SCRIPT = REPO / "benchmarks" / "step_overhead.py"


def test_quick_run_checks_agreement_and_prints_ratios():
    env = child_env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    result = subprocess.run(
        python_command(SCRIPT, "--quick", "--skip-large", "--skip-startup", "--skip-train", preloaded=True, children=True),
        capture_output=True, text=True, timeout=240, env=env, cwd=REPO,
    )
    output = result.stdout
    assert result.returncode == 0, f"{output[-3000:]}\n{result.stderr[-5000:]}"
    assert re.search(r"\[tiny\] agreement: old logprobs max \|ours - ref\| \S+ \(tol 1e-04\) OK; "
                     r"first-update loss ours \S+ ref \S+ rel diff \S+ \(tol 1e-05\) OK", output), output
    assert re.search(r"\[tiny\] ratio ours/reference per update: \d+\.\d+x \(goal <= 2x: (met|GOAL MISSED)\)", output), output
    assert re.search(r"\[tiny\] ratio ours/reference per old-logprob pass: \d+\.\d+x", output), output
    assert "[tiny] profile of our update" in output and "__torch_function__" in output, output
    assert "[large]" not in output
    assert "Traceback" not in result.stderr
