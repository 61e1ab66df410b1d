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


# --------------------------------------------------------------------------- harness, early exit, cache

HARNESS = "x = int(input())\nprint({code})"
DOUBLE = [{"stdin": "3\n", "stdout": "6\n"}, {"stdin": "10\n", "stdout": "20\n"}, {"stdin": "-1\n", "stdout": "-2\n"}]


def sandbox_calls(**settings) -> int:
    """Calls the reward's sandbox (one per process and settings) has made so far."""
    from megatron_rl.rewards.code_tests import sandbox_for

    key = (float(settings.get("wall_seconds", 5.0)), int(settings.get("cpu_seconds", 5)),
           int(settings.get("memory_mb", 512)), settings.get("isolation", "namespaces"))
    return sum(sandbox_for(*key).counts.values())


def test_a_harness_turns_an_expression_into_the_program():
    assert code_tests_reward("", "x*2", None, tests=DOUBLE, harness=HARNESS) == 1.0
    assert code_tests_reward("", " x+x \n", None, tests=DOUBLE, harness=HARNESS) == 1.0  # stripped
    assert code_tests_reward("", "x*3", None, tests=DOUBLE, harness=HARNESS) == 0.0
    # without the harness the bare expression is a program that prints nothing
    assert code_tests_reward("", "x*2", None, tests=DOUBLE) == 0.0
    # plain substitution: other braces of the template stay as written
    assert code_tests_reward("", "x*2", None, tests=DOUBLE,
                             harness="x = int(input())\nprint({'v': {code}}['v'])") == 1.0
    # through the registry, as a run resolves it: the param reaches the function
    assert resolve_reward("code_tests", {"harness": HARNESS}).fn("", "x*2", None, tests=DOUBLE) == 1.0


def test_a_harness_without_the_placeholder_is_refused_naming_the_key():
    for bad in ("x = int(input())\nprint(x)", "{ code }", 7):
        with pytest.raises(ConfigError, match=r"rewards\.terms\[\]\.params\.harness must be a program template "
                                              r"containing \{code\}"):
            resolve_reward("code_tests", {"harness": bad})
    with pytest.raises(ValueError, match="record's 'harness' metadata"):
        code_tests_reward("", "x*2", None, tests=DOUBLE, harness="print(1)")
    with pytest.raises(ConfigError, match="cache_entries must be an integer >= 0"):
        resolve_reward("code_tests", {"cache_entries": -1})


def test_mode_all_stops_at_the_first_failing_test():
    before = sandbox_calls()
    assert code_tests_reward("", "x*3", None, tests=DOUBLE, harness=HARNESS, mode="all") == 0.0
    assert sandbox_calls() - before == 1  # the first test failed: the other two are not run
    before = sandbox_calls()
    assert code_tests_reward("", "x*3", None, tests=DOUBLE, harness=HARNESS) == 0.0
    assert sandbox_calls() - before == 3  # fraction: every test counts


def test_cached_verdicts_answer_an_identical_program_without_a_call():
    tests = [{"stdin": "41\n", "stdout": "82\n"}]  # a test no other test of this module runs
    before = sandbox_calls()
    assert code_tests_reward("", "x*2", None, tests=tests, harness=HARNESS, cache_entries=8) == 1.0
    assert code_tests_reward("", "x*2", None, tests=tests, harness=HARNESS, cache_entries=8) == 1.0
    assert sandbox_calls() - before == 1
    # a different program, or the cache off, runs again
    assert code_tests_reward("", "x+x", None, tests=tests, harness=HARNESS, cache_entries=8) == 1.0
    assert code_tests_reward("", "x*2", None, tests=tests, harness=HARNESS) == 1.0
    assert sandbox_calls() - before == 3


# --------------------------------------------------------------------------- exit status, HumanEval records

ADD_PROMPT = 'def add(a, b):\n    """The sum of a and b."""\n'
ADD_TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"


def test_an_exit_code_test_passes_on_the_status_whatever_is_printed():
    assert code_tests_reward("", "print('noise')\nassert 1 + 1 == 2", None, tests=[{"exit_code": 0}]) == 1.0
    assert code_tests_reward("", "assert 1 + 1 == 3", None, tests=[{"exit_code": 0}]) == 0.0
    assert code_tests_reward("", "import sys\nsys.exit(3)", None, tests=[{"exit_code": 3}]) == 1.0
    # a limit is not an exit status: a program killed at the wall time fails every exit test
    assert code_tests_reward("", "while True: pass", None, tests=[{"exit_code": 0}], wall_seconds=0.5,
                             cpu_seconds=1) == 0.0
    for bad in ({"exit_code": 0, "stdout": ""}, {"exit_code": "0"}, {"exit_code": True}):
        with pytest.raises(ValueError, match="test 0 must be a dict with a string 'stdout' or an integer 'exit_code'"):
            code_tests_reward("", "pass", None, tests=[bad])


# Completions that end the process, or fake its end, before check() ran: each exits 0 unless caught.
EARLY_EXITS = {
    "sys.exit": "    import sys\n    sys.exit(0)\n",
    "os._exit": "    import os\n    os._exit(0)\n",
    "SystemExit": "    raise SystemExit(0)\n",
    "reads stdin": "    import os, sys\n    print(sys.stdin.read())\n    print(os.read(0, 4096))\n    os._exit(0)\n",
    "reads its source": "    import sys\n    print(open(sys.argv[0]).read())\n    sys.exit(0)\n",
    "prints a fake marker": "    import os\n    print('0123456789abcdef0123456789abcdef')\n    os._exit(0)\n",
    "replaces print": ("    import builtins, os\n    builtins.print = lambda *a, **k: os.write(1, b'0' * 32 + b'\\n')\n"
                       "    print()\n    raise SystemExit(0)\n"),
}
# The right body that replaces the output functions: the harness bound its own before the program ran.
RIGHT_WITH_OUTPUT_REPLACED = ("    import builtins, os, sys\n    builtins.print = lambda *a, **k: None\n"
                              "    sys.stdout = open(os.devnull, 'w')\n    os.write = lambda fd, data: len(data)\n"
                              "    return a + b\n")


def test_a_program_that_ends_itself_early_fails_an_exit_0_test():
    """Exit status 0 is not a pass: the program must run to its end (module docstring of
    code_tests), which a completion that exits, fakes the end marker or replaces the output
    functions cannot show; the right body, printing or not, still passes."""
    record = {"entry_point": "add", "test": ADD_TEST}
    scores = {name: code_tests_reward(ADD_PROMPT, body, None, **record) for name, body in EARLY_EXITS.items()}
    assert scores == dict.fromkeys(EARLY_EXITS, 0.0)
    assert code_tests_reward(ADD_PROMPT, "    print('partial', end='')\n    return a + b\n", None, **record) == 1.0
    assert code_tests_reward(ADD_PROMPT, RIGHT_WITH_OUTPUT_REPLACED, None, **record) == 1.0
    # a plain program's exit-0 test too; its own stdin is still there after the marker's line
    assert code_tests_reward("", "import sys\nsys.exit(0)\nassert False", None, tests=[{"exit_code": 0}]) == 0.0
    assert code_tests_reward("", "assert input() == 'hi'", None, tests=[{"exit_code": 0, "stdin": "hi\n"}]) == 1.0


def test_a_humaneval_record_runs_prompt_completion_test_and_check():
    """The composition HumanEval scores with: a completion continues the prompt's function; a
    fenced whole function replaces it; a wrong body fails check(); prints do not matter."""
    record = {"entry_point": "add", "test": ADD_TEST}
    assert code_tests_reward(ADD_PROMPT, "    return a + b\n", None, **record) == 1.0
    assert code_tests_reward(ADD_PROMPT, "    print('x')\n    return a - b\n", None, **record) == 0.0
    fenced = "Here it is:\n```python\ndef add(a, b):\n    return b + a\n```\n"
    assert code_tests_reward(ADD_PROMPT, fenced, None, **record) == 1.0
    # a fenced block that does not define the entry point is a completion (here: not even Python)
    assert code_tests_reward(ADD_PROMPT, "```python\nx = 1\n```", None, **record) == 0.0
    # both fields, or neither
    with pytest.raises(ValueError, match="needs 'entry_point' .* and 'test'"):
        code_tests_reward(ADD_PROMPT, "    return a + b\n", None, entry_point="add")
    with pytest.raises(ValueError, match="a harness cannot apply"):
        code_tests_reward(ADD_PROMPT, "    return a + b\n", None, harness=HARNESS, **record)


def test_a_records_metadata_cannot_change_the_sandbox(tmp_path, caplog):
    """Every metadata field reaches the reward as a keyword argument; one named like a sandbox
    param (`isolation: none`, `memory_mb`) must not take the program out of the namespace sandbox
    or raise its limits, with or without configured params. The field is dropped, warned about once."""
    escaped = tmp_path / "escaped"
    writes = f"open({str(escaped)!r}, 'w').write('x')\nprint('done')"
    allocates = "block = bytearray(700 * 2**20)\nprint('done')"  # over the default 512 MB
    done = [{"stdout": "done\n"}]
    for params in ({}, {"wall_seconds": 5}):
        reward = resolve_reward("code_tests", params).fn
        assert reward("", writes, None, tests=done, isolation="none") == 0.0
        assert not escaped.exists()
        assert reward("", allocates, None, tests=done, memory_mb=100000) == 0.0
    assert reward("", "print('done')", None, tests=done, isolation="none") == 1.0  # only the field is dropped
    warnings = [r.getMessage() for r in caplog.records if "metadata field 'isolation' is ignored" in r.getMessage()]
    assert len(warnings) == 2, warnings  # one per field and reward instance (two here), not per sample

