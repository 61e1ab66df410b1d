"""The built-in `python` tool (rollout.tools: ["python"]): the model's program run in the sandbox.

Each call is a fresh sandboxed process (sandbox/runner.py: its own namespaces, no network, an
empty working directory, 10 s wall / 5 s CPU / 512 MB, 64 KiB of output kept). What it printed
is the observation; a program that fails (an exception, a limit, a timeout) comes back as a
tool error, which the tool environment counts (`agent/tool_errors`) and shows the model with the
last lines of its traceback. On a machine without user namespaces the run refuses to start (preflight);
a tool of your own can wrap `Sandbox(isolation="none")` after weighing what that opens.
"""

from __future__ import annotations

import functools

from megatron_rl.agents.tools import ToolError
from megatron_rl.sandbox import Sandbox, SandboxLimits

LIMITS = SandboxLimits(wall_seconds=10, cpu_seconds=5, memory_mb=512)
TAIL_LINES = 2  # of stderr shown to the model when its program fails (error observations are short)


@functools.lru_cache(maxsize=1)
def tool_sandbox() -> Sandbox:
    """One per process, two jails built ahead (calls come from the rollout's thread pool)."""
    return Sandbox(LIMITS, warm=2)


def python(code: str) -> str:
    """Run a Python 3 program in a sandbox (no network, no files but its own, 10 s) and return
    what it printed to standard output.

    Args:
        code: the whole program; print the values you need to see.
    """
    result = tool_sandbox().run_python(code)
    if result.ok:
        return result.stdout
    detail = {"timeout": f"the program ran past {LIMITS.wall_seconds:g} s and was stopped",
              "cpu_limit": f"the program used more than {LIMITS.cpu_seconds} s of CPU and was stopped",
              "output_limit": f"the program printed more than {LIMITS.output_bytes} bytes and was stopped",
              "memory_limit": f"the program ran out of memory ({LIMITS.memory_mb} MB)",
              "disk_limit": f"the program ran out of disk ({LIMITS.disk_mb} MB or {LIMITS.disk_files} files in "
                            "/work and /tmp)"}.get(result.status)
    if detail is None:
        detail = f"the program failed ({result.status}, exit code {result.exit_code})"
    # the end of the traceback says what went wrong (the registry cuts error observations short)
    tail = [line.strip() for line in result.stderr.splitlines() if line.strip()][-TAIL_LINES:]
    raise ToolError(f"error: python: {detail}" + (": " + " | ".join(tail) if tail else ""))
