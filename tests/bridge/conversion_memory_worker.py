"""Run by tests/bridge/test_streamed.py: the peak anonymous memory of conversion tool runs, each
forked from this one fresh process once it has imported what the conversions import (one import of
torch and Megatron-Core for all of them instead of one per run: most of each run's time).

    conversion_memory_worker.py OUT.json TOOL ARGS... [-- TOOL ARGS...]

Each TOOL ARGS... is a `python TOOL ARGS...` command line of a script in tools/; it runs in a fork,
as the script's __main__, while this process reads the fork's RssAnon (allocated memory, not mapped
files) every 10 ms. OUT.json: the largest seen for each, in bytes, in order. A run that fails ends
this process with its exit status.

What a fork measures: its RssAnon starts with this process's pages (the imports), as a fresh run's
includes its own imports, and what the conversion allocates comes on top; every run starts from
the same state, so the runs compare with each other as fresh processes do. This process is not
forked from the tests' pre-imported server: its resident memory would start with that server's.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback
from pathlib import Path


def preload() -> None:
    """What the conversions import, so that the forks do not import it again."""
    import megatron.core  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    import megatron_rl.bridge.hf_checkpoint  # noqa: F401
    import megatron_rl.bridge.importer  # noqa: F401
    import megatron_rl.bridge.streamed  # noqa: F401
    import megatron_rl.checkpoint.unpickling  # noqa: F401
    import megatron_rl.model.builder  # noqa: F401
    import megatron_rl.runtime.session  # noqa: F401
    import megatron_rl.tools.convert  # noqa: F401
    import megatron_rl.tools.convert_lora  # noqa: F401


def run_in_fork(argv: list[str]) -> int:
    """`python ARGV...` in a fork: its exit status there (the fork ends with it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 (reported, and the fork's exit status says it failed)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def peak_anon_bytes(pid: int) -> tuple[int, int]:
    """(the largest RssAnon of process `pid` seen every 10 ms until it ends, its exit status)."""
    status = Path(f"/proc/{pid}/status")
    peak = 0
    while True:
        done, wait_status = os.waitpid(pid, os.WNOHANG)
        if done:
            return peak, os.waitstatus_to_exitcode(wait_status)
        try:
            line = next(x for x in status.read_text().splitlines() if x.startswith("RssAnon:"))
            peak = max(peak, int(line.split()[1]) * 1024)
        except (OSError, StopIteration):
            pass
        time.sleep(0.01)


def main() -> None:
    out, rest = Path(sys.argv[1]), sys.argv[2:]
    commands, current = [], []
    for arg in rest + ["--"]:
        if arg == "--":
            commands.append(current)
            current = []
        else:
            current.append(arg)
    preload()
    peaks = []
    for argv in commands:
        peak, code = peak_anon_bytes(run_in_fork(argv))
        if code != 0:
            print(f"{' '.join(argv)}: exit status {code}", file=sys.stderr)
            sys.exit(code if code > 0 else 1)
        peaks.append(peak)
    out.write_text(json.dumps(peaks) + "\n")


if __name__ == "__main__":
    main()
