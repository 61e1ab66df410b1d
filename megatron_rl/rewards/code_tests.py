"""The `code_tests` reward: model-written Python run against a record's test cases, in the sandbox.

A record carries its tests in its metadata, `tests: [{"stdin": "...", "stdout": "..."}, ...]`:
the program reads its standard input and prints; it passes a test when its output equals the
expected one (trailing whitespace of each line and trailing blank lines ignored). The program is
the response's last ```python (or bare ```) fenced block, or the whole response when it has none.

Each test is its own sandbox call (sandbox/runner.py: fresh namespaces, no network, the limits
below), so a program that hangs, floods, forks or allocates fails that test and nothing else;
the scorer never sees an exception from the program. The reward is the fraction of tests passed
(`mode: fraction`, the default) or 1 when all pass, else 0 (`mode: all`).

Params (rewards.terms[].params): wall_seconds (5), cpu_seconds (5), memory_mb (512), mode, and
isolation: "namespaces" (the default; refused at start-up on a machine without them) or "none",
the explicit opt-out that keeps the limits but lets the program use the network and this
user's files.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from megatron_rl.sandbox import Sandbox, SandboxLimits

FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
MODES = ("fraction", "all")


def extract_program(response: str) -> str:
    """The last fenced code block of `response`, or all of it when it has none."""
    blocks = FENCE.findall(response)
    return blocks[-1] if blocks else response


def same_output(actual: str, expected: str) -> bool:
    def lines(text: str) -> list[str]:
        out = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while out and not out[-1]:
            out.pop()
        return out

    return lines(actual) == lines(expected)


@functools.lru_cache(maxsize=8)
def sandbox_for(wall_seconds: float, cpu_seconds: int, memory_mb: int, isolation: str) -> Sandbox:
    """One Sandbox per process and settings (its construction probes the kernel once), with a
    jail built ahead so a test's call does not wait for the namespaces and mounts."""
    return Sandbox(SandboxLimits(wall_seconds=wall_seconds, cpu_seconds=cpu_seconds, memory_mb=memory_mb),
                   isolation=isolation, warm=1)


def check_tests(tests: Any) -> list[dict]:
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"the 'code_tests' reward needs records whose 'tests' metadata is a non-empty list of "
                         f"{{'stdin': ..., 'stdout': ...}}, got {type(tests).__name__}")
    for index, test in enumerate(tests):
        if not isinstance(test, dict) or not isinstance(test.get("stdout"), str) \
                or not isinstance(test.get("stdin", ""), str):
            raise ValueError(f"the 'code_tests' reward: test {index} must be a dict with a string 'stdout' (and "
                             f"optionally 'stdin'), got {test!r}")
    return tests


def code_tests_reward(prompt: str, response: str, answer: str | None, *, tests: Any = None,
                      wall_seconds: float = 5.0, cpu_seconds: int = 5, memory_mb: int = 512,
                      mode: str = "fraction", isolation: str = "namespaces", **metadata: Any) -> float:
    tests = check_tests(tests)
    sandbox = sandbox_for(float(wall_seconds), int(cpu_seconds), int(memory_mb), isolation)
    program = extract_program(response)
    passed = 0
    for test in tests:
        result = sandbox.run_python(program, stdin=test.get("stdin", ""))
        passed += result.ok and same_output(result.stdout, test["stdout"])
    if mode == "all":
        return float(passed == len(tests))
    return passed / len(tests)
