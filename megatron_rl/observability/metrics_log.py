"""What a user reads during and after a run: a console line per step, metrics.jsonl, wandb.

    log = MetricsLog(output_dir, total_steps, wandb=config.logging, resume_step=k, enabled=is_driver)
    log.step(step, metrics)       # one JSON line per step (every metric), one console line
    log.close()

Every metric of a step goes to OUTPUT_DIR/metrics.jsonl as one JSON object with "step". On
resume the file is cut back to the checkpoint's step first, so steps the interrupted run
logged after its last checkpoint are not duplicated; a fresh run starts an empty file. wandb is
offline by default (files under OUTPUT_DIR/wandb, `wandb sync` uploads them later) and online
when configured.

wandb never fails the run once it has started (a bad wandb setup is still an error at start-up).
It logs through a helper process (wandb-core) that a stop signal sent to the whole job (SLURM at
preemption, the time limit or a requeue; `scancel`; systemd) kills as well, while the trainer is
still finishing its step and writing the stop checkpoint. So a failing wandb call prints one line,
wandb is off for the rest of the run and metrics.jsonl stays the record; finishing the wandb run at
the end is bounded by `wandb_finish_timeout_s` (60 s by default).

Every row also carries two wall-clock keys (never compared by the exact-resume check):

    "time"        Unix time (seconds, float) when the row was written
    "elapsed_s"   seconds of run time up to this row: counted from the MetricsLog's creation
                  (the trainer creates it once the policy is built) and, on resume, continued
                  from the elapsed_s of the last row kept after the cut-back. So elapsed_s is the
                  run time that produced the kept rows, summed over the interrupted and resumed
                  processes; the time an interrupted process spent on steps after its last
                  checkpoint (thrown away, then redone) and the gap between the processes are
                  not counted. elapsed_s never decreases down the file; time does not either
                  unless the system clock is set back.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from megatron_rl.errors import ConfigError

# The console line: (metric key, label, format). Missing keys are left out.
CONSOLE = [
    ("reward/mean", "reward", "{:.3f}"),
    ("eval/accuracy", "eval-acc", "{:.3f}"),
    ("teacher/accuracy", "teacher-acc", "{:.3f}"),  # rl.teacher's own held-out accuracy (step 0)
    ("train/accuracy", "acc", "{:.3f}"),
    ("actor/kl", "kl", "{:.4f}"),
    ("distill/reverse_kl", "teacher-kl", "{:.4f}"),  # on-policy distillation: KL(student || teacher) per token
    ("actor/entropy", "entropy", "{:.3f}"),
    ("actor/clip_frac", "clip", "{:.3f}"),
    ("moe/routing_drift", "drift", "{:.3f}"),
    ("response/length_mean", "len", "{:.1f}"),
]
PHASES = ["generate", "score", "teacher", "logprobs", "train", "sync"]
WALL_CLOCK = ("time", "elapsed_s")  # keys every row carries; they differ between identical runs


class MetricsLog:
    def __init__(self, output_dir: str | Path, total_steps: int, *, wandb_mode: str = "offline",
                 wandb_project: str = "megatron-rl", run_name: str | None = None, config: dict | None = None,
                 resume_step: int | None = None, enabled: bool = True, stream=None,
                 wandb_finish_timeout_s: float = 60.0):
        self.enabled, self.total_steps = enabled, total_steps
        self.path = Path(output_dir) / "metrics.jsonl"
        self.stream = stream or sys.stdout
        self._wandb = None
        self._started = time.monotonic()  # elapsed_s is measured on the monotonic clock
        self._elapsed_before = 0.0  # run time of the rows kept from interrupted processes
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A fresh run (no checkpoint step, or 0) starts a new file: rows of an earlier attempt in
        # this directory that never checkpointed would otherwise stay, and step 0 appear twice.
        notice = truncate_metrics(self.path, resume_step if resume_step else -1)
        if notice:
            print(notice, file=self.stream, flush=True)
        if resume_step:
            self._elapsed_before = max((r.get("elapsed_s", 0.0) for r in read_metrics(self.path)), default=0.0)
        if wandb_mode != "disabled":
            run = _start_wandb(Path(output_dir), wandb_mode, wandb_project, run_name, config, resume_step)
            self._wandb = GuardedWandb(run, self.path, self.stream, finish_timeout_s=wandb_finish_timeout_s)

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{key: _plain(value) for key, value in sorted(metrics.items())}}
        record["time"] = time.time()
        record["elapsed_s"] = self._elapsed_before + (time.monotonic() - self._started)
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log(record, step)
        print(self.console_line(step, record), file=self.stream, flush=True)

    def console_line(self, step: int, record: dict[str, Any]) -> str:
        parts = [f"step {step}/{self.total_steps}"]
        for key, label, fmt in CONSOLE:
            value = record.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                parts.append(f"{label} {fmt.format(value)}")
        times = [f"{phase} {record[f'time/{phase}_s']:.1f}" for phase in PHASES if f"time/{phase}_s" in record]
        if times:
            parts.append("[s: " + " ".join(times) + "]")
        return "  ".join(parts)

    def message(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


class GuardedWandb:
    """A started wandb run whose failures never reach the training run.

    Every call is guarded: the first one that raises prints one line naming the error, and wandb
    is off from then on (its helper process, if still there, is ended and the connection to it
    dropped, so wandb's own exit hook does not wait on it either). finish() gets
    `finish_timeout_s`: a helper that hangs rather than dies would otherwise hold up the exit.
    """

    def __init__(self, run, metrics_path: Path, stream, *, finish_timeout_s: float):
        self.run, self.metrics_path, self.stream = run, metrics_path, stream
        self.finish_timeout_s = finish_timeout_s

    def log(self, record: dict[str, Any], step: int) -> None:
        if self.run is not None:
            self._guarded("log", lambda: self.run.log(record, step=step))

    def finish(self) -> None:
        if self.run is not None:
            self._guarded("finish", lambda: _within(self.finish_timeout_s, self.run.finish))
            self.run = None

    def _guarded(self, what: str, call) -> None:
        try:
            call()
        except (Exception, SystemExit) as exc:  # not KeyboardInterrupt: Ctrl-C still interrupts
            self._give_up(what, exc)

    def _give_up(self, what: str, exc: BaseException) -> None:
        first_line = (str(exc).splitlines() or [""])[0]
        print(f"wandb {what} failed ({type(exc).__name__}: {first_line}); wandb is off for the rest of this "
              f"run, metrics continue in {self.metrics_path}", file=self.stream, flush=True)
        self.run = None
        _drop_wandb_service()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The file's records; lines that are not one (see _parse_lines) are left out."""
    path = Path(path)
    if not path.is_file():
        return []
    return [record for _, _, record in _parse_lines(path) if record is not None]


def _parse_lines(path: Path) -> list[tuple[int, str, dict[str, Any] | None]]:
    """(line number, text, record or None) for every non-blank line. A line that is not a JSON
    object is None: the last one when a kill (SIGKILL, OOM, a node lost) cut its write short, or
    any line a person or a full disk damaged. Rows are written by json.dumps (ASCII), so bytes
    that do not decode are damage too."""
    parsed = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            record = None
        parsed.append((number, line, record if isinstance(record, dict) else None))
    return parsed


def truncate_metrics(path: Path, keep_through_step: int) -> str | None:
    """Keep only records with step <= keep_through_step (atomic rewrite). Lines that are not
    records are left out, the file as it was kept beside it, and a line saying so returned (a
    resume after a kill must not die on the half-written row the kill left)."""
    if not path.is_file():
        return None
    parsed = _parse_lines(path)
    kept = [line for _, line, record in parsed if record is not None and record.get("step", 0) <= keep_through_step]
    unreadable = [number for number, _, record in parsed if record is None]
    notice = None
    if unreadable:
        aside = path.with_name(f"{path.name}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.copy2(path, aside)
        shown = ", ".join(map(str, unreadable[:5])) + (", ..." if len(unreadable) > 5 else "")
        notice = (f"{path}: line(s) {shown} are not metric records (a write cut short by a kill, or damage); "
                  f"left out, the file as it was is kept as {aside}")
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text("".join(line + "\n" for line in kept))
    os.replace(temporary, path)
    return notice


def check_wandb_available(mode: str) -> None:
    """Called during config validation, before any expensive work."""
    if mode == "disabled":
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"logging.wandb_mode={mode!r} needs the wandb package: pip install 'megatron-rl[wandb]', "
            "or set logging.wandb_mode=disabled"
        ) from None


def _start_wandb(output_dir: Path, mode: str, project: str, name: str | None, config: dict | None, resume_step):
    import wandb

    directory = output_dir / "wandb"
    directory.mkdir(parents=True, exist_ok=True)
    # The run id is stored beside the metrics so a resumed run continues the same wandb run.
    id_file = output_dir / ".wandb_run_id"
    run_id = id_file.read_text().strip() if resume_step and id_file.is_file() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id)
    return wandb.init(project=project, name=name, id=run_id, resume="allow", dir=str(directory), mode=mode,
                      config=config or {}, settings=wandb.Settings(silent=True, console="off"))


def _within(timeout_s: float, call) -> None:
    """Runs `call` on a daemon thread; its exception, or TimeoutError when it has not returned
    in `timeout_s` (the thread is left behind: a daemon does not hold up the exit)."""
    outcome: list[BaseException] = []

    def target():
        try:
            call()
        except BaseException as exc:  # noqa: BLE001  (handed to the caller, who decides)
            outcome.append(exc)

    thread = threading.Thread(target=target, name="wandb-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer from wandb in {timeout_s:g} s")
    if outcome:
        raise outcome[0]


# How long dropping the connection to a dead or killed wandb service may take.
_DROP_TIMEOUT_S = 10.0


def _drop_wandb_service() -> None:
    """After a failure: ends this process's wandb helper if it still runs (a hung one would make
    wandb's exit hook wait for it forever) and tears down wandb's connection to it, which also
    removes that exit hook (it would print the same error again at exit) and lets a later
    wandb.init in this process start a fresh helper. Best effort, bounded, never raises."""
    import psutil
    import wandb

    try:
        for child in psutil.Process().children():
            if child.name().startswith("wandb-core"):
                child.kill()
    except psutil.Error:
        pass
    try:
        _within(_DROP_TIMEOUT_S, wandb.teardown)
    except (Exception, SystemExit):  # wandb.teardown exits with the helper's exit code
        pass


def _plain(value):
    if hasattr(value, "item"):
        return value.item()
    return value
