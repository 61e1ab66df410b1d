"""The `learns` check of benchmarks/gpu_engine.py: `megatron-rl train` with the built-in tiny default
recipe for a short run, on whatever device the run picks (device: auto, so the GPU where there is
one): held-out accuracy before RL (after the warm start) and after it, and the step's phases in
seconds, beside the same run on CPU.

The CPU figures are the committed dry run's (benchmarks/results/gpu_engine_cpu.json, the same
command on a 2-core CPU machine); the report names the file and its date.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CPU_RESULTS = REPO / "benchmarks" / "results" / "gpu_engine_cpu.json"
RL_STEPS = 40  # of the default's 150: what fits the GPU machine's few minutes with the warm start
ARGS = [f"rl.steps={RL_STEPS}", "rl.eval_every=0", "checkpoint.every_steps=0", "checkpoint.export_hf=false",
        "logging.wandb_mode=disabled"]
PHASES = ("time/generate_s", "time/score_s", "time/logprobs_s", "time/train_s", "time/sync_s", "time/step_s")


def summarize(records: list[dict]) -> dict:
    """Held-out accuracy before and after RL, and each phase's median over the steps after the
    first (which also pays for compiling and the caches' first fill)."""
    steps = {record["step"]: record for record in records if "step" in record}
    before, last = steps.get(0, {}), steps.get(max(steps), {}) if steps else {}
    later = [steps[s] for s in sorted(steps) if s >= 2]
    figures = {"steps": max(steps) if steps else 0,
               "held-out accuracy before RL": before.get("eval/accuracy"),
               "held-out accuracy after RL": last.get("eval/accuracy"),
               "first step s": steps.get(1, {}).get("time/step_s")}
    figures["phases, median s per step (steps 2-)"] = {
        phase.removeprefix("time/").removesuffix("_s"): round(statistics.median(r[phase] for r in later), 4)
        for phase in PHASES if later and all(phase in r for r in later)}
    return figures


def cpu_reference() -> dict | None:
    if not CPU_RESULTS.exists():
        return None
    data = json.loads(CPU_RESULTS.read_text())
    learns = data["checks"].get("learns", {})
    if learns.get("status") != "passed":
        return None
    return {"from": f"{CPU_RESULTS.relative_to(REPO)} ({data['date']}, the same command, CPU)", **learns["figures"]}


def check_learns(device: str, options: dict) -> dict:
    out = Path(options["out_dir"]) / "learns"
    command = [sys.executable, "-m", "megatron_rl.cli", "train", "--output-dir", str(out), *ARGS]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    seconds = time.perf_counter() - started
    (Path(options["out_dir"]) / "logs" / "learns-train.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"megatron-rl train exited with {result.returncode}:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    figures = {"command": "megatron-rl train " + " ".join(ARGS), "device": device, "wall s": round(seconds, 1),
               **summarize(records)}
    before, after = figures["held-out accuracy before RL"], figures["held-out accuracy after RL"]
    checks = [{"check": "held-out accuracy after RL minus before (must be > 0)", "value": after - before,
               "tolerance": 0.0, "ok": after > before}]
    if device == "cuda":
        reference = cpu_reference()
        figures["CPU, same run"] = reference or f"no passed CPU run in {CPU_RESULTS.relative_to(REPO)}"
        if reference:
            gpu, cpu = figures["phases, median s per step (steps 2-)"], reference["phases, median s per step (steps 2-)"]
            figures["CPU / GPU per phase"] = {phase: round(cpu[phase] / gpu[phase], 2)
                                              for phase in gpu if phase in cpu and gpu[phase] > 0}
    return {"figures": figures, "checks": checks}
