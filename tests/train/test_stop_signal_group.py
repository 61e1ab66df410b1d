"""The graceful stop when SIGTERM reaches every process of the run, as SLURM (preemption, time limit,
requeue, `scancel`) and systemd deliver it, not only the trainer (test_train_loop.py's exact-resume
test signals the trainer alone).

`megatron-rl launch local --nproc-per-node 1` (what launch/tiny_cpu.sh runs) on the shortened tiny
default with wandb offline (the default mode), started in its own session. Once step 0's console
line (the evaluation before RL) is out, SIGTERM goes to the run's process group (os.killpg) and to
every process below it in other sessions: torchrun and its rank, wandb's helper process
(wandb-core), the checkpoint helpers. A tiny step takes about 0.3 s, less than the test may take to
notice the line and signal on a loaded machine (it once took two steps): the run has STEPS steps so
that a late signal still stops it before its end; it usually stops after step 1 or 2.
A process group alone does not reach them (torchrun's ranks and wandb-core start their own
sessions); a job's cgroup or SLURM's process tracking does.

Asserts: exit code 0, "stopped by SIGTERM after step N", a stop checkpoint of step N on disk and
run_state.json unfinished at N, wandb's failure reported in one line instead of failing the run,
every step up to N in metrics.jsonl.

Also (fast): a rank started with the stop signals blocked, as launch local starts them, keeps one
sent during its start-up and notes it once its handler is installed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from _support.processes import REPO, child_env, cli_command
from megatron_rl.train.stop_signals import block_stop_signals

STEPS = 8  # see the module docstring: room for a late signal; the run stops long before
# No warm start: nothing here depends on what the policy knows.
OVERRIDES = {"rl.steps": str(STEPS), "warm_start.steps": "0", "logging.wandb_mode": "offline"}


def test_a_signal_during_start_up_waits_for_the_handler():
    code = """
import os, signal
from megatron_rl.train.stop_signals import StopSignals
stop = StopSignals()
os.kill(os.getpid(), signal.SIGTERM)  # before the handler: held, not fatal
print("before", stop.received)
stop.install()
print("after", stop.received)
"""
    result = subprocess.run([sys.executable, "-c", code], preexec_fn=block_stop_signals, capture_output=True,
                            text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[:2] == ["before None", "after SIGTERM"], result.stdout


def command(out: Path) -> list[str]:
    from test_train_loop import SHORT  # imported here: it skips without vLLM

    short = [item for item in SHORT if item.split("=", 1)[0] not in OVERRIDES]
    return cli_command("launch", "local", "--nproc-per-node", "1", "--output-dir", str(out), *short,
                       *(f"{key}={value}" for key, value in OVERRIDES.items()))


def signal_every_process(root: psutil.Process, number: int) -> list[str]:
    """`number` to root's process group, then to each process below root outside that group: what
    a signal to a whole job reaches. Returns the processes signalled (for the failure message)."""
    group = os.getpgid(root.pid)
    below = root.children(recursive=True)
    os.killpg(group, number)
    reached = [f"group {group}"]
    for process in below:
        try:
            if os.getpgid(process.pid) != group:
                process.send_signal(number)
                reached.append(f"{process.pid} {process.name()}")
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return reached


def run_signalled_after_step(out: Path, step: int, timeout: float = 600) -> tuple[int, str, list[str]]:
    """Starts the run in its own session and signals all of it once `step`'s console line is
    printed; (exit code, output, what was signalled)."""
    process = subprocess.Popen(command(out), env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            if line.startswith(f"step {step}/"):
                seen.set()
        seen.set()  # the output ended without it: the assertions below say why

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reached: list[str] = []
    try:
        assert seen.wait(timeout), "".join(lines)[-4000:]
        if process.poll() is None:
            reached = signal_every_process(psutil.Process(process.pid), signal.SIGTERM)
        process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    reader.join(timeout=30)
    return process.returncode, "".join(lines), reached


@pytest.mark.engine
def test_sigterm_to_the_whole_run_checkpoints_and_exits_0(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")
    pytest.importorskip("wandb", reason="wandb is not installed (pip install -e .[wandb])")
    from run_records import metrics

    out = tmp_path / "run"
    code, output, reached = run_signalled_after_step(out, 0)
    assert code == 0, f"signalled {reached}\n{output[-6000:]}"
    assert any("wandb-core" in item for item in reached), reached  # the helper the fault was about
    stopped = re.search(r"stopped by SIGTERM after step (\d+); checkpoint (\S+)\.", output)
    assert stopped, output[-4000:]
    step = int(stopped.group(1))
    assert 1 <= step < STEPS
    assert Path(stopped.group(2)).name == f"step_{step:06d}" and Path(stopped.group(2)).is_dir()
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{step:06d}"
    assert json.loads((out / "run_state.json").read_text()) == {"step": step, "finished": False}
    assert not (out / "run.lock").exists(), "the stopped run must release its directory (train/run_lock.py)"
    # wandb's helper died of the same signal: one line says so, metrics.jsonl kept every step.
    warnings = re.findall(r"^wandb (?:log|finish) failed \(.*metrics continue in .*metrics\.jsonl$", output, re.M)
    assert len(warnings) == 1, output[-4000:]
    assert sorted(metrics(out)) == list(range(step + 1))
    # Resuming from a stop checkpoint is shown by test_train_loop.py's exact-resume test and by
    # the live SLURM requeue test (which also signals every process of the job): not run again.
