"""One check of a GPU stage run in a process of its own, with its own time limit, its report read back.

Shared by benchmarks/gpu_verify.py (its stages a-f) and benchmarks/gpu_engine.py (its engine
checks), and its process runner by benchmarks/moe_perf.py (its slice cases): each runs a check as a child command in a process group of its own, so that a check that
hangs (a CUDA kernel, an engine's workers) is killed with everything it started at its limit and
the next check still runs; the child writes its report (JSON: `checks`, `figures`, or `error`)
and this reads it back with a status. The results' Markdown shows each check's table and error
the same way in both.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import traceback
from pathlib import Path


def run_child(command: list[str], env: dict, log: Path, report: Path, budget: float, what: str) -> dict:
    """Run `command` (which writes `report`) for at most `budget` seconds, its output into `log`;
    the report with `status` (passed, failed, error, timed out) and `seconds`. `what` names the
    check in an error ("stage", "check")."""
    log.parent.mkdir(parents=True, exist_ok=True)
    report.parent.mkdir(parents=True, exist_ok=True)
    report.unlink(missing_ok=True)  # a report left by an earlier run must not pass for this one's
    code, seconds = run_process(command, log, budget, env)
    seconds = round(seconds, 1)
    if code is None:
        return {"status": "timed out", "seconds": seconds, "error": f"killed after its limit of {budget:g} s",
                "log_tail": log_tail(log)}
    if not report.exists():
        return {"status": "error", "seconds": seconds, "error": f"the {what} process exited with {code} and no report",
                "log_tail": log_tail(log)}
    result = {**json.loads(report.read_text()), "seconds": seconds}
    if "error" in result:
        result["status"] = "error"
        result["log_tail"] = log_tail(log)
    else:
        result["status"] = "passed" if all(c["ok"] for c in result["checks"]) else "failed"
    return result


def run_process(command: list[str], log: Path, limit: float, env: dict) -> tuple[int | None, float]:
    """A process in its own session, killed with its children at `limit` seconds: (exit code or
    None, seconds)."""
    started = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    return code, time.perf_counter() - started


def log_tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def error_report(exc: BaseException) -> dict:
    """In the child, inside `except`: the error and the traceback's last lines, as its report
    (the whole traceback goes to the log)."""
    traceback.print_exc()
    return {"error": f"{type(exc).__name__}: {exc}"[:2000],
            "traceback": "".join(traceback.format_exc().splitlines(keepends=True)[-8:])}


def check_lines(result: dict) -> list[str]:
    """A result's table of checks and its error, traceback and log tail, as Markdown lines."""
    lines = []
    if result.get("checks"):
        lines += ["", "| check | value | tolerance | ok |", "| --- | --- | --- | --- |"]
        lines += [f"| {c['check']} | {c['value']:.4g} | {c['tolerance']:g} | {c['ok']} |" for c in result["checks"]]
    for key in ("error", "traceback", "log_tail"):
        if result.get(key):
            lines += ["", f"{key.replace('_', ' ')}:", "", "```", result[key].rstrip(), "```"]
    return lines
