"""Colocated vLLM CPU engines' shared memory (runtime/cpu/vllm_shm.py): a crashed run no longer
blocks the next one, and two runs share a host.

vLLM's CPU build named the segments after the init method (`env://`), the same for every run: a
rank killed with SIGKILL left them in /dev/shm and every re-run failed at engine start with
`create shm in SHMManager failed. errno: 17`. Only vLLM's AVX-512 kernels use these segments (its
AVX2 build has no shared-memory communicator), so on an AVX2-only CPU the collision itself cannot
occur; the test plants a dead run's segments under both namings (the old shared name, and one of
ours whose run is gone), which on an AVX-512 machine reproduces the failure, and on every machine
checks that the re-run removes them and says so. That vLLM takes each run's own name is checked
in test_vllm_sync.py (the colocated TP2 / EP2 cases) on any CPU.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from _support.processes import child_env, cli_command
from megatron_rl.runtime.cpu.vllm_shm import stale_segments

SHM = Path("/dev/shm")
SHORT = ["parallel.ep=2", "parallel.etp=1", "rl.prompts_per_step=4", "rl.group_size=2", "rl.updates_per_rollout=1",
         "rl.max_response_tokens=4", "warm_start.steps=0", "data.num_heldout=4", "rl.eval_every=0",
         "logging.wandb_mode=disabled"]


def test_stale_segments_are_the_unmapped_old_ones(tmp_path):
    """Unit: which files count as a dead run's (fake /dev/shm and /proc trees)."""
    shm, proc = tmp_path / "shm", tmp_path / "proc"
    shm.mkdir()
    (proc / "4242").mkdir(parents=True)
    names = ["-tp:0-[0-1]-cpushm_0", "megatron-rl-7-ab-tp:0-[0-1]-cpushm_1", "in-use-tp:0-[0-1]-cpushm_0",
             "young-tp:0-[0-1]-cpushm_0", "psm_1234"]
    for name in names:
        (shm / name).write_bytes(b"x")
    old = time.time() - 3600
    for name in names[:3] + names[4:]:
        os.utime(shm / name, (old, old))
    (proc / "4242" / "maps").write_text(f"7f00-7f10 rw-s 00000000 00:1a 12 {SHM}/in-use-tp:0-[0-1]-cpushm_0\n")
    found = [path.name for path in stale_segments(shm, proc)]
    assert found == sorted(names[:2]), found  # not the mapped one, the young one, nor other files


def launch(out: Path, preloaded: bool = False) -> subprocess.Popen:
    """`megatron-rl launch local` on 2 ranks; preloaded: the launcher, its torchrun and the ranks
    forked from the pre-imported server (not for the run whose rank the test finds and kills: its
    ranks must be this process's descendants)."""
    command = cli_command("launch", "local", "--nproc-per-node", "2", "--output-dir", str(out), *SHORT, "rl.steps=2",
                          preloaded=preloaded, children=preloaded)
    return subprocess.Popen(command, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_for_first_metrics(process: subprocess.Popen, out: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    metrics = out / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert process.poll() is None, f"exited with {process.returncode} before its first step:\n{process.stdout.read()}"
        assert time.monotonic() < deadline, "no metrics line in time"
        time.sleep(0.5)


@pytest.mark.engine
@pytest.mark.multiprocess
def test_rank_killed_with_sigkill_then_the_same_command_and_another_run_both_work(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")
    crashed = tmp_path / "crashed"
    first = launch(crashed)
    # Killed once its engines are up (its step-0 evaluation is logged).
    wait_for_first_metrics(first, crashed)
    ranks = [child for child in psutil.Process(first.pid).children(recursive=True)
             if "megatron_rl.cli" in " ".join(child.cmdline()) and "train" in child.cmdline()]
    assert len(ranks) >= 2, [r.cmdline() for r in ranks]
    os.kill(sorted(ranks, key=lambda r: r.pid)[-1].pid, signal.SIGKILL)
    first.wait(timeout=300)
    assert first.returncode != 0

    # A dead run's segments under the old shared name and under ours: on an AVX-512 CPU the first
    # is exactly what blocked every later run.
    planted = [SHM / "-tp:0-[0-1]-cpushm_0", SHM / "megatron-rl-1-dead-tp:0-[0-1]-cpushm_1"]
    old = time.time() - 3600
    # Any run on this host that starts a colocated engine removes stale segments, and a test on
    # another worker may start one between the planting and this run's engine start: then the
    # segments are gone but named in that run's output, not in ours. The claim (this run removes
    # and names them) is then checked again on a run of its own, planted anew.
    said, attempts = "", 0
    try:
        while True:
            attempts += 1
            for path in planted:
                path.write_bytes(b"\0" * 4096)
                os.utime(path, (old, old))
            if attempts == 1:  # the same command, and a second run beside it
                runs = [launch(crashed, preloaded=True), launch(tmp_path / "other", preloaded=True)]
            else:
                runs = [launch(tmp_path / f"again-{attempts}", preloaded=True)]
            outputs = [run.communicate(timeout=900)[0] for run in runs]
            for run, output in zip(runs, outputs):
                assert run.returncode == 0, output[-5000:]
            said = "".join(outputs)
            if all(path.name in said for path in planted) or attempts == 3:
                break
            assert not any(path.exists() for path in planted), f"a run left stale segments in place:\n{said[-3000:]}"
    finally:
        for path in planted:
            path.unlink(missing_ok=True)
    assert "stale vLLM shared-memory segment(s)" in said, said[-3000:]
    for path in planted:
        assert path.name in said, f"after {attempts} run(s) of our own:\n{said[-3000:]}"
    assert not [path for path in SHM.iterdir() if "-cpushm" in path.name and path.name.startswith("megatron-rl-")
                and path.stat().st_mtime > old + 60], "a finished run left its segments"
