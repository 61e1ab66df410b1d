"""metrics.jsonl wall-clock keys: every row has `time` (Unix seconds) and `elapsed_s` (run time),
both non-decreasing, and `elapsed_s` continues across a resume from the last kept row."""

from __future__ import annotations

import io
import time

from megatron_rl.observability.metrics_log import WALL_CLOCK, MetricsLog, read_metrics


def log_steps(log: MetricsLog, steps, pause: float = 0.02) -> None:
    for step in steps:
        time.sleep(pause)
        log.step(step, {"reward/mean": 0.1 * step})


def test_every_row_has_wall_clock_keys_and_they_never_decrease(tmp_path):
    started = time.time()
    log = MetricsLog(tmp_path, 4, wandb_mode="disabled", stream=io.StringIO())
    log_steps(log, range(0, 5))
    log.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    for row in rows:
        assert set(WALL_CLOCK) <= set(row), row
        assert started <= row["time"] <= time.time()
    for before, after in zip(rows, rows[1:]):
        assert after["time"] >= before["time"]
        assert after["elapsed_s"] > before["elapsed_s"]  # 20 ms apart
    assert rows[0]["elapsed_s"] >= 0.02
    # The other keys are untouched.
    assert rows[3]["reward/mean"] == 0.1 * 3


def test_elapsed_continues_across_a_resume(tmp_path):
    first = MetricsLog(tmp_path, 6, wandb_mode="disabled", stream=io.StringIO())
    log_steps(first, range(0, 5))  # interrupted after step 4; its last checkpoint is step 2
    first.close()
    interrupted = {r["step"]: r for r in read_metrics(tmp_path / "metrics.jsonl")}

    time.sleep(0.3)  # the gap between the processes is not run time
    resumed = MetricsLog(tmp_path, 6, wandb_mode="disabled", resume_step=2, stream=io.StringIO())
    log_steps(resumed, range(3, 7))
    resumed.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    assert rows[:3] == [interrupted[s] for s in range(3)]  # kept rows unchanged
    for before, after in zip(rows, rows[1:]):
        assert after["time"] >= before["time"]
        assert after["elapsed_s"] > before["elapsed_s"]
    kept_elapsed = interrupted[2]["elapsed_s"]
    # Step 3 of the resumed process: the kept run time plus a little (one 20 ms pause), not the
    # interrupted process's step-3/4 time and not the 0.3 s gap.
    assert kept_elapsed + 0.02 <= rows[3]["elapsed_s"] < kept_elapsed + 0.25
    assert rows[3]["time"] >= interrupted[4]["time"] + 0.3


def test_a_fresh_run_starts_a_new_file_at_zero_elapsed(tmp_path):
    # An earlier attempt in the same directory that never checkpointed (the trainer then starts
    # fresh, resume_step 0): its rows go, so no step appears twice and elapsed_s starts at 0.
    stale = MetricsLog(tmp_path, 4, wandb_mode="disabled", stream=io.StringIO())
    log_steps(stale, range(0, 3), pause=0.1)
    stale.close()
    log = MetricsLog(tmp_path, 4, wandb_mode="disabled", resume_step=0, stream=io.StringIO())
    log_steps(log, [0, 1])
    log.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["elapsed_s"] < 0.25 and rows[1]["elapsed_s"] > rows[0]["elapsed_s"]


def test_a_row_cut_short_by_a_kill_is_left_out_on_resume_and_the_file_kept_beside(tmp_path):
    """SIGKILL while a row was being written leaves half a JSON line at the end of metrics.jsonl:
    the resume died in json.loads with a traceback (its checkpoint never reached). The torn row
    (and any line that is not a record) is left out with one line, the file as it was kept."""
    first = MetricsLog(tmp_path, 6, wandb_mode="disabled", stream=io.StringIO())
    log_steps(first, range(0, 4), pause=0)
    first.close()
    path = tmp_path / "metrics.jsonl"
    before = path.read_text() + '{"step": 4, "reward/me'  # the kill, mid-write
    path.write_text(before)
    stream = io.StringIO()
    resumed = MetricsLog(tmp_path, 6, wandb_mode="disabled", resume_step=3, stream=stream)
    log_steps(resumed, [4], pause=0)
    resumed.close()
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3, 4]
    (aside,) = tmp_path.glob("metrics.jsonl.unreadable-*")
    assert aside.read_text() == before
    assert f"{path}: line(s) 5 are not metric records" in stream.getvalue() and str(aside) in stream.getvalue()
    # Plotting reads what is there, the damaged line left out.
    path.write_text(before)
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3]
