"""benchmarks/prompt_preflight.py must keep working: it writes synthetic prompts, reads them with
the run's reader, runs preflight's length check and a plain tokenizer call over the same texts,
checks both find the same overlong prompts and prints the rates and the ratio. Only that it runs
and what it prints are checked here, not the timings."""

import re
import subprocess
import sys

import pytest

from _support.processes import REPO, child_env

pytestmark = pytest.mark.subprocess  # runs a child process (pyproject's marks; scripts/test.sh --quick)

NUMBER = r"\d[\d,]*(?:\.\d+)?"


def test_small_run_prints_rates_and_the_ratio():
    env = child_env(OMP_NUM_THREADS="2")
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "prompt_preflight.py"), "--prompts", "2000"],
                            capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    output = result.stdout
    assert re.search(r"^prompts: 2000 \(16-160 characters, mean \d+\.\d; \d+\.\d tokens on average\), "
                     r"data.prompt_format=raw, tokenizer: the tiny default's \(character-level\)", output, re.M), output
    assert re.search(rf"^read \+ parse \(load_prompts\): {NUMBER} s, {NUMBER} prompts/s$", output, re.M), output
    check = re.search(rf"^length check \(preflight.overlong_prompts\): {NUMBER} s, {NUMBER} prompts/s, "
                      rf"{NUMBER} s per 1M prompts; (\d+) over (\d+) tokens$", output, re.M)
    assert check and 0 < int(check.group(1)) < 2000, output  # the limit leaves some prompts over it
    assert re.search(rf"^reference, tokenizer\(batch\) over the same texts: {NUMBER} s, {NUMBER} prompts/s, "
                     rf"{NUMBER} s per 1M prompts$", output, re.M), output
    assert re.search(rf"^ratio check/reference: {NUMBER} \(goal <= 1.0: (met|GOAL MISSED)\); "
                     rf"check/read\+parse: {NUMBER}$", output, re.M), output
    assert "Traceback" not in result.stderr
