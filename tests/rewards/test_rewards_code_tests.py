"""The `code_tests` reward: programs against a record's tests in the real sandbox, through the
real scorer (worker processes), hostile programs included: each scores 0 for its tests, the
batch completes, and no reward error is counted (a hostile program is a wrong answer, not a
broken reward)."""

from __future__ import annotations

import pytest

from megatron_rl.errors import ConfigError
from megatron_rl.rewards import resolve_reward
from megatron_rl.rewards.code_tests import code_tests_reward, extract_program
from megatron_rl.rewards.scoring import RewardInput, RewardScorer, RewardTerm

TESTS = [{"stdin": "3\n", "stdout": "9\n"}, {"stdin": "-4\n", "stdout": "16"}, {"stdin": "0\n", "stdout": "0\n\n"}]
SQUARE = "n = int(input())\nprint(n * n)\n"


def test_the_fraction_of_tests_a_program_passes():
    assert code_tests_reward("", SQUARE, None, tests=TESTS) == 1.0
    assert code_tests_reward("", "n = int(input())\nprint(n * n if n > 0 else n)\n", None, tests=TESTS) == \
        pytest.approx(2 / 3)  # -4 -> -4 fails
    assert code_tests_reward("", "n = int(input())\nprint(n * n if n > 0 else n)\n", None, tests=TESTS,
                             mode="all") == 0.0
    assert code_tests_reward("", "print(undefined)", None, tests=TESTS) == 0.0


def test_the_program_is_the_last_fenced_block():
    response = f"First try:\n```python\nprint(1)\n```\nBetter:\n```python\n{SQUARE}```\nDone."
    assert extract_program(response) == SQUARE
    assert code_tests_reward("", response, None, tests=TESTS) == 1.0
    assert extract_program("print(2)") == "print(2)"


HOSTILE = {
    "infinite loop": "while True: pass",
    "sleep": "import time\ntime.sleep(100)",
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "10 GB": "x = bytearray(10 * 1024**3)\nprint(9)",
    "output flood": "import sys\nwhile True: sys.stdout.write('9' * 65536)",
    "socket to 127.0.0.1": "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\nprint(9)",
    "escape": "import os\nos.system('touch /usr/escaped')\nprint(open('/etc/hostname').read())",
}


def test_hostile_programs_score_zero_and_the_scorer_carries_on():
    term = RewardTerm("code_tests", params={"wall_seconds": 2, "cpu_seconds": 1, "memory_mb": 256})
    samples = [RewardInput("square it", program, None, {"tests": TESTS[:1]}) for program in HOSTILE.values()]
    samples.append(RewardInput("square it", SQUARE, None, {"tests": TESTS}))
    with RewardScorer([term], timeout_s=60, num_workers=2) as scorer:
        result = scorer.score(samples)
    assert result.rewards == [0.0] * len(HOSTILE) + [1.0], dict(zip([*HOSTILE, "square"], result.rewards))
    assert result.errors == 0 and result.timeouts == 0, result.first_error


def test_bad_params_and_records_are_named():
    with pytest.raises(ConfigError, match="unknown parameter 'timeout'"):
        resolve_reward("code_tests", {"timeout": 3})
    with pytest.raises(ConfigError, match="mode must be one of fraction, all"):
        resolve_reward("code_tests", {"mode": "any"})
    with pytest.raises(ConfigError, match="memory_mb must be a number > 0"):
        resolve_reward("code_tests", {"memory_mb": 0})
    with pytest.raises(ConfigError, match="isolation must be 'namespaces' or 'none'"):
        resolve_reward("code_tests", {"isolation": "off"})
    assert resolve_reward("code_tests", {"isolation": "none"}).name == "code_tests"
    with pytest.raises(ValueError, match="'tests' metadata is a non-empty list"):
        code_tests_reward("", SQUARE, None)
    with pytest.raises(ValueError, match="test 0 must be a dict with a string 'stdout'"):
        code_tests_reward("", SQUARE, None, tests=[{"stdin": "1"}])
