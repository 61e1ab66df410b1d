"""The `code_tests` reward: model-written Python run against a record's test cases, in the sandbox.

A record carries its tests in its metadata, `tests: [{"stdin": "...", "stdout": "..."}, ...]`:
the program reads its standard input and prints; it passes a test when its output equals the
expected one (trailing whitespace of each line and trailing blank lines ignored). A test
`{"exit_code": 0}` (stdin optional, no stdout) passes when the program runs to its end, whatever
it prints: tests written as asserts (below: a program that ends itself early fails it). A test
`{"exit_code": N}` with N != 0 passes when the program ends by itself with that status; it trusts
the status, which any program can choose (`sys.exit(N)`), so it checks a deliberate exit and
nothing more. The program is the response's last ```python (or bare ```) fenced block, or the
whole response when it has none.

HumanEval-format records (metadata `entry_point` and `test`, the fields HumanEval.jsonl has;
evaluation/humaneval.py reads such sets) are programs composed as HumanEval scores them: the
prompt (imports, helpers, the signature and docstring), then the response as written (a
completion continuing the function's body) or, when its last fenced block defines the entry
point, that block (a whole function, which replaces the prompt's), then the row's `test` and
`check(entry_point)`; their tests default to one `{"exit_code": 0}` (check() returned).

Running to the end, not just exiting with 0: an exit status of 0 is what `sys.exit(0)`,
`raise SystemExit(0)` and `os._exit(0)` give too, so a model that ends the process before the
asserts would pass every such test (and RL would learn it). An `{"exit_code": 0}` test therefore
runs the program inside a small harness (`run_to_end`): the scorer draws a fresh random marker
for each sandbox call and sends it as the first line of standard input; the harness reads that
line before any of the program runs (the program's own stdin is what follows), executes the
program from a string, and only after it returns flushes the program's output and writes the
marker with os.write on descriptor 1. The test passes when the program exits with 0 and its
output ends with that marker line. The marker is in no file (the program text and the harness
can be read by the program, they do not hold it), not in the environment or the arguments, and
no longer in stdin; a program that reads stdin gets its own input; printing a made-up marker,
replacing `print` or `sys.stdout`, or exiting early all leave the last line wrong or absent.
Threat model, what this does not cover: a program written against this harness can still find
the marker in the harness's own state in its process (walking up the call stack to the
harness's frame, reading its memory); no in-process check can hide from code running in that
process, and HumanEval's own runner is in-process as well. Nor does it cover Python-level tricks
inside the asserts (a returned object whose `__eq__` is always true). The verdict cache keeps the
pass/fail of a (program, test) pair, never a marker; each call draws a new one.

Each test is its own sandbox call (sandbox/runner.py: fresh namespaces, no network, the limits
below), so a program that hangs, floods, forks or allocates fails that test and nothing else;
the scorer never sees an exception from the program. The reward is the fraction of tests passed
(`mode: fraction`, the default) or 1 when all pass, else 0 (`mode: all`, which stops at the first
failing test: most samples early in training fail, and each test is a process).

Params (rewards.terms[].params): wall_seconds (5), cpu_seconds (5), memory_mb (512), mode,
isolation: "namespaces" (the default; refused at start-up on a machine without them) or "none",
the explicit opt-out that keeps the limits but lets the program use the network and this
user's files; and harness: a program template containing ``{code}``, for tasks whose answer is
a fragment rather than a program. The extracted code, stripped of surrounding whitespace, is put
in place of ``{code}`` (plain substitution: other braces stay as written), e.g. with
``"x = int(input())\\nprint({code})"`` the answer ``x*2+1`` runs as that two-line program (the
synthetic `expr` task, configs/tiny_code.yaml). A harness without ``{code}`` is refused when the
reward is resolved, naming ``rewards.terms[].params.harness``; a record may also carry its own
``harness`` metadata (the param wins), checked when it is scored. cache_entries (0, off): each
scorer worker keeps the pass/fail of that many (program, test) pairs it has run and answers an
identical program's test from it, without a sandbox call; a policy's group often repeats a
response. Leave it 0 where programs may be nondeterministic (the clock, `random`). All but
harness are the config's alone: the registry binds each (configured or default), so a record's
metadata field of the same name cannot choose the sandbox or its limits (rewards/registry.py).
"""

from __future__ import annotations

import collections
import functools
import re
import secrets
from typing import Any

from megatron_rl.sandbox import Sandbox, SandboxLimits

FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
MODES = ("fraction", "all")
PLACEHOLDER = "{code}"


def extract_program(response: str) -> str:
    """The last fenced code block of `response`, or all of it when it has none."""
    blocks = FENCE.findall(response)
    return blocks[-1] if blocks else response


def check_harness(harness: Any, where: str = "rewards.terms[].params.harness") -> str | None:
    """The harness, or None; a ValueError naming `where` when it is not a string with {code}."""
    if harness is None:
        return None
    if not isinstance(harness, str) or PLACEHOLDER not in harness:
        raise ValueError(f"{where} must be a program template containing {PLACEHOLDER} (where the model's code goes, "
                         f"e.g. 'x = int(input())\\nprint({{code}})'), got {harness!r}")
    return harness


def build_program(response: str, harness: str | None = None) -> str:
    """The program a response stands for: its code (extract_program), inside the harness if any."""
    program = extract_program(response)
    if harness is None:
        return program
    return harness.replace(PLACEHOLDER, program.strip())


# The harness of an {"exit_code": 0} test (module docstring). A function, so the marker lives in
# its locals and not in the __main__ module's dict; os.write and the original stdout/stderr are
# bound before the program runs, so replacing them changes nothing here.
RUN_TO_END = """\
def _run_to_end(source):
    import os, sys
    write, out, err = os.write, sys.stdout, sys.stderr
    end = b"\\n" + sys.stdin.buffer.readline()  # the scorer's marker line, read before the program runs
    exec(compile(source, "<program>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    out.flush()
    err.flush()
    write(1, end)


_run_to_end(%s)
"""


def run_to_end(program: str) -> str:
    """`program` inside the harness that writes the marker read from stdin after the program returned."""
    return RUN_TO_END % repr(program)


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


def completion_program(prompt: str, response: str, entry_point: str, test: str) -> str:
    """HumanEval's program for a response (module docstring): prompt + completion (or the fenced
    function that redefines `entry_point`) + the row's tests + check(entry_point)."""
    blocks = FENCE.findall(response)
    if blocks and re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", blocks[-1], re.MULTILINE):
        body = f"{prompt}\n{blocks[-1]}"
    else:
        body = prompt + response
    return f"{body}\n\n{test}\n\ncheck({entry_point})\n"


def check_tests(tests: Any) -> list[dict]:
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"the 'code_tests' reward needs records whose 'tests' metadata is a non-empty list of "
                         f"{{'stdin': ..., 'stdout': ...}} or {{'exit_code': 0}}, got {type(tests).__name__}")
    for index, test in enumerate(tests):
        exit_kind = isinstance(test, dict) and "exit_code" in test
        if not isinstance(test, dict) or not isinstance(test.get("stdin", ""), str) or (
                exit_kind and ("stdout" in test or isinstance(test["exit_code"], bool)
                               or not isinstance(test["exit_code"], int))) or (
                not exit_kind and not isinstance(test.get("stdout"), str)):
            raise ValueError(f"the 'code_tests' reward: test {index} must be a dict with a string 'stdout' or an "
                             f"integer 'exit_code' (not both; optionally a string 'stdin'), got {test!r}")
    return tests


class _Verdicts:
    """Pass/fail of (program, test, settings) already run in this process, the newest `size` kept.
    A policy's group often repeats a response, and an unchanged program passes or fails a test the
    same way again unless it is nondeterministic (reads the clock, the random module), which is
    why this is off unless `cache_entries` is set."""

    def __init__(self):
        self.entries: collections.OrderedDict[tuple, bool] = collections.OrderedDict()

    def get(self, key: tuple) -> bool | None:
        if key in self.entries:
            self.entries.move_to_end(key)
        return self.entries.get(key)

    def put(self, key: tuple, passed: bool, size: int) -> None:
        self.entries[key] = passed
        while len(self.entries) > size:
            self.entries.popitem(last=False)


_VERDICTS = _Verdicts()


def passes(sandbox: Sandbox, program: str, test: dict, cache_entries: int, settings: tuple) -> bool:
    """Whether `program` passes one test: a sandbox call, or the cached verdict of an identical one."""
    key = (program, test.get("stdin", ""), test.get("stdout"), test.get("exit_code"), settings)
    if cache_entries and (known := _VERDICTS.get(key)) is not None:
        return known
    if test.get("exit_code") == 0:  # ran to its end: exit 0 and the marker written after it (module docstring)
        marker = secrets.token_hex(16)
        result = sandbox.run_python(run_to_end(program), stdin=f"{marker}\n{test.get('stdin', '')}")
        passed = result.ok and result.stdout.endswith(f"\n{marker}\n")
    elif "exit_code" in test:  # ended by itself (not a limit or a signal) with that status: trusted
        result = sandbox.run_python(program, stdin=test.get("stdin", ""))
        passed = result.status == "error" and result.exit_code == test["exit_code"]
    else:
        result = sandbox.run_python(program, stdin=test.get("stdin", ""))
        passed = result.ok and same_output(result.stdout, test["stdout"])
    if cache_entries:
        _VERDICTS.put(key, passed, cache_entries)
    return passed


def code_tests_reward(prompt: str, response: str, answer: str | None, *, tests: Any = None,
                      wall_seconds: float = 5.0, cpu_seconds: int = 5, memory_mb: int = 512,
                      mode: str = "fraction", isolation: str = "namespaces", harness: str | None = None,
                      cache_entries: int = 0, entry_point: str | None = None, test: str | None = None,
                      **metadata: Any) -> float:
    if entry_point is not None or test is not None:  # a HumanEval-format record
        if not isinstance(entry_point, str) or not entry_point.isidentifier() or not isinstance(test, str):
            raise ValueError(f"the 'code_tests' reward: a HumanEval-format record needs 'entry_point' (the "
                             f"function's name) and 'test' (code defining check(candidate)) as strings, got "
                             f"entry_point={entry_point!r} and test of type {type(test).__name__}")
        if harness is not None:
            raise ValueError("the 'code_tests' reward: a HumanEval-format record (entry_point, test) composes its "
                             "own program; a harness cannot apply to it")
        tests = check_tests([{"exit_code": 0}] if tests is None else tests)
        program = completion_program(prompt, response, entry_point, test)
    else:
        tests = check_tests(tests)
        program = build_program(response, check_harness(harness, "the 'code_tests' reward's harness (a param or "
                                                                 "the record's 'harness' metadata)"))
    settings = (float(wall_seconds), int(cpu_seconds), int(memory_mb), isolation)
    sandbox = sandbox_for(*settings)
    passed = 0
    for test in tests:
        if passes(sandbox, program, test, int(cache_entries), settings):
            passed += 1
        elif mode == "all":
            return 0.0  # decided: the remaining tests cannot change it (a sandbox call each saved)
    if mode == "all":
        return 1.0
    return passed / len(tests)
