"""wandb failing mid-run never fails the run: the real offline wandb helper process (wandb-core)
killed by SIGTERM, as a stop signal sent to the whole job kills it, or hung (SIGSTOP).

- killed: every later MetricsLog.step and close() returns, one warning line names the error and
  metrics.jsonl, metrics.jsonl and the console keep every step, and a later wandb run in the same
  process starts a fresh helper;
- hung: close() returns within its bound, the warning names the timeout, the helper is ended.
"""

from __future__ import annotations

import io
import re
import signal
import time

import pytest

pytest.importorskip("wandb", reason="wandb is not installed (pip install -e .[wandb])")
psutil = pytest.importorskip("psutil")

from megatron_rl.observability.metrics_log import MetricsLog, read_metrics  # noqa: E402

WARNING = re.compile(r"^wandb (log|finish) failed \((\w+): .*\); wandb is off for the rest of this run, "
                     r"metrics continue in (\S+)$")


def wandb_service() -> psutil.Process:
    """This process's wandb helper: wandb.init starts it as a child of the calling process."""
    services = [child for child in psutil.Process().children() if child.name().startswith("wandb-core")]
    assert len(services) == 1, [(child.pid, child.name()) for child in psutil.Process().children()]
    return services[0]


def ended_or_gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def warnings(stream: io.StringIO) -> list[re.Match]:
    return [match for line in stream.getvalue().splitlines() if (match := WARNING.match(line))]


def log_steps(log: MetricsLog, steps) -> None:
    for step in steps:
        log.step(step, {"reward/mean": 0.1 * step})


def test_killed_wandb_service_leaves_the_run_and_metrics_alone(tmp_path):
    stream = io.StringIO()
    log = MetricsLog(tmp_path, 6, wandb_mode="offline", stream=stream)
    log_steps(log, range(0, 3))
    service = wandb_service()
    service.send_signal(signal.SIGTERM)
    service.wait(timeout=30)

    log_steps(log, range(3, 7))  # must not raise
    log.close()

    found = warnings(stream)
    assert len(found) == 1, stream.getvalue()
    assert found[0].group(3) == str(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl")] == list(range(7))
    assert [line.split()[1] for line in stream.getvalue().splitlines() if line.startswith("step ")] == \
        [f"{step}/6" for step in range(7)]
    assert ended_or_gone(service)

    # The dead helper is forgotten: the next wandb run of this process starts and finishes cleanly.
    again = io.StringIO()
    fresh = MetricsLog(tmp_path / "again", 1, wandb_mode="offline", stream=again)
    log_steps(fresh, [0, 1])
    fresh.close()
    assert not warnings(again), again.getvalue()


def test_hung_wandb_service_does_not_hold_up_close(tmp_path):
    stream = io.StringIO()
    log = MetricsLog(tmp_path, 2, wandb_mode="offline", stream=stream, wandb_finish_timeout_s=3)
    log_steps(log, range(0, 3))
    service = wandb_service()
    service.suspend()  # SIGSTOP: alive, never answers
    try:
        tick = time.monotonic()
        log.close()
        took = time.monotonic() - tick
        ended = ended_or_gone(service)
    finally:
        if not ended_or_gone(service):
            service.kill()
    found = warnings(stream)
    assert len(found) == 1 and found[0].group(1, 2) == ("finish", "TimeoutError"), stream.getvalue()
    # The 3 s bound, then ending the helper and dropping the connection (10 s at most).
    assert 3 <= took < 3 + 10 + 2, took
    assert ended, "close() left the hung helper running"
    assert [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
