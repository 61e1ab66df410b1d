"""A command's interpreter leaves its heap out of its last garbage collections (megatron_rl/cli.py):
after a run, the collections at the interpreter's exit walked everything torch, Megatron-Core,
transformers and vLLM had allocated (2.5 s of a 4.4 s exit after `megatron-rl sft` on 2 cores).

A fresh Python imports the CLI with a heap of 200,000 live objects and exits normally; an exit
handler registered before the import runs after the CLI's (last in, first out) and reports how
many objects the collector no longer examines."""

from __future__ import annotations

import subprocess
import sys

import pytest

from _support.processes import child_env

pytestmark = pytest.mark.subprocess  # a fresh interpreter: its exit is the claim

CHILD = """
import atexit, gc
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count(), flush=True))
heap = [[i] for i in range(200_000)]  # what a run keeps alive until it ends
import megatron_rl.cli
"""


def test_the_heap_is_out_of_the_collectors_view_at_exit():
    result = subprocess.run([sys.executable, "-c", CHILD], env=child_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    frozen = int(result.stdout.rsplit("frozen at exit:", 1)[-1])
    assert frozen >= 200_000, result.stdout
