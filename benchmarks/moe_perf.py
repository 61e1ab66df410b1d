"""One unattended MoE performance sweep on one GPU, with the goals beside the figures.

    bash scripts/gpu_kit/run.sh --perf RESULTS_DIR            # the GPU machine: installs the kit, then this
    bash scripts/gpu_kit/run.sh --perf --dry-run RESULTS_DIR  # CPU: the same pipeline, tiny (the suite runs it)
    python benchmarks/moe_perf.py --out DIR [--dry-run] [--phases AB] [--deadline-s 450] [--peak-tflops P]

Phase A (benchmarks/moe_perf_gemm.py, one process): te.GroupedLinear alone at the expert GEMM shapes
one GPU sees, cuBLAS vs CUTLASS, fused wgrad off/on: host enqueue time, CUDA-event GPU time,
TFLOP/s and a CUDA-graph replay (the kernels' ceiling).
Phase B (benchmarks/moe_slice.py, a process per case): a Qwen3-30B-A3B-shaped slice at EP1 (all 128
experts on the GPU) and as one GPU of EP8 (16 experts; an upper bound: no all-to-all), forced
balanced routing, 5 warm-up + 5 timed steps, the levers added one by one (LEVERS), then blockwise
FP8 with routing padding at the best BF16 setting, then the best case again under the profiler.
Each case's loss is compared with its EP's baseline over the same steps (BF16 noise: 2^-8).

RESULTS_DIR/moe_perf.jsonl gets one line per case as the case ends; RESULTS_DIR/moe_perf.md is
written again after every case (benchmarks/moe_perf_report.py: the tables and the goals), and with it
RESULTS_DIR/step_times.jsonl, the measured cases as `megatron-rl plan --measured`'s table. A global
deadline (--deadline-s, run.sh passes what its budget leaves) bounds every process: a case cut by
it is recorded as timed out, the cases after it as not run. Case logs: RESULTS_DIR/logs/.
The dry run (CPU, tiny model) runs the cases whose levers apply on a CPU and records the others as
gpu-only; its figures are the CPU's and say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from check_process import log_tail, run_process  # noqa: E402  (its slice cases' processes, as the GPU stages')
import moe_perf_gemm  # noqa: E402
import moe_perf_report  # noqa: E402

# (name, overrides, runs on a CPU): added one by one; a case keeps the levers before it that were
# measured with the baseline's loss (one refused on this machine, or failed, is left out after).
# ONE_MICRO_BATCH stands for micro_batch_tokens = the step's tokens (16,384 on the GPU).
ONE_MICRO_BATCH = "micro_batch_tokens={tokens_per_step}"
LEVERS = [
    ("fused wgrad", ["model.gradient_accumulation_fusion=true"], False),
    ("CUTLASS", ["model.moe_grouped_gemm_backend=cutlass"], False),
    ("one micro-batch", [ONE_MICRO_BATCH], True),
    # This step has no old-logprob pass; with the default two updates per rollout the key refuses
    # the fused router (the routing-drift record needs the router's hook, which the kernel skips).
    ("router fusion", ["model.moe_router_fusion=true", "rl.updates_per_rollout=1"], False),
]
FP8 = ("FP8 blockwise, padded", ["model.fp8_recipe=blockwise", "model.moe_router_padding_for_fp8=true"], False)
# The FP8 case leaves these out of the best BF16 setting: TE's CUTLASS grouped GEMM takes no FP8
# operands (the config refuses the pair).
NOT_WITH_FP8 = ("CUTLASS",)
EPS = (8, 1)  # EP8 first: three of the four goals are about it
GPU_SHAPE = {"hidden": 2048, "heads": 32, "kv-heads": 4, "head-dim": 128, "experts": 128, "top-k": 8,
             "expert-width": 768, "vocab": 151936, "steps": 10, "warmup": 5, "tokens-per-step": 16384,
             "micro-batch-tokens": 8192, "min-len": 512, "max-len": 4096}
DRY_SHAPE = {"layers": 2, "hidden": 64, "heads": 4, "kv-heads": 2, "head-dim": 16, "experts": 32, "top-k": 2,
             "expert-width": 48, "vocab": 256, "steps": 3, "warmup": 1, "tokens-per-step": 512,
             "micro-batch-tokens": 256, "min-len": 16, "max-len": 128}
LIMITS = {"gpu": {"phase_a": 90.0, "case": 120.0, "min_case": 15.0},
          "dry": {"phase_a": 120.0, "case": 240.0, "min_case": 0.1}}
# The time kept for the profile of the best case: its case's own seconds times this (a profiled step more).
PROFILE_RESERVE = 1.3


class Deadline:
    """Seconds left before the sweep's global deadline (clock injectable for tests)."""

    def __init__(self, seconds: float, clock=time.perf_counter):
        self.seconds, self.clock, self.started = seconds, clock, clock()

    def left(self) -> float:
        return self.seconds - (self.clock() - self.started)

    def limit(self, own: float, minimum: float, reserve: float = 0.0) -> float | None:
        """A process's time limit: its own, cut to what is left; None when less than `minimum` would be
        left after keeping `reserve` seconds for later."""
        left = self.left()
        return None if left - reserve < minimum else min(own, left - reserve)


def check_lever_keys() -> None:
    """Every lever names a config key of this checkout (a typo or a missing key stops the sweep
    before anything runs, not case by case on the GPU)."""
    from megatron_rl.config import ModelConfig, RLConfig, RunConfig

    def fields(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    sections = {"": fields(RunConfig), "model": fields(ModelConfig), "rl": fields(RLConfig)}
    for _, overrides, _ in [*LEVERS, FP8]:
        for override in overrides:
            key = override.split("=", 1)[0]
            section, _, name = key.rpartition(".")
            if name not in sections.get(section, {}):
                raise SystemExit(f"moe_perf.py: lever {override!r} names {key}, which is not a config key here "
                                 f"(megatron_rl/config); fix LEVERS in {Path(__file__).name}")


def config_refusal(overrides: list[str]) -> str | None:
    """The config's own refusal of these overrides (machine-independent, at load), or None."""
    from megatron_rl.config import load_config
    from megatron_rl.errors import ConfigError

    try:
        load_config(None, ["model.precision=bf16", *overrides])
    except ConfigError as exc:
        return str(exc)
    return None


def make_case(ep: int, name: str, levers: list[tuple], **extra) -> dict:
    """A phase-B case: its levers' names and overrides; `_levers` (the tuples) stays out of the JSONL."""
    return {"phase": "B", "case": name, "ep": ep, "levers": [n for n, _, _ in levers],
            "set": [o for _, sets, _ in levers for o in sets], "on_cpu": all(c for _, _, c in levers),
            "_levers": list(levers), **extra}


def fp8_case(ep: int, best: dict) -> dict:
    kept = [lever for lever in best["_levers"] if lever[0] not in NOT_WITH_FP8]
    left_out = [lever[0] for lever in best["_levers"] if lever[0] in NOT_WITH_FP8]
    return make_case(ep, f"EP{ep} {FP8[0]} at '{best['case']}'", kept + [FP8], fp8=True, base=best["case"],
                     without=left_out)


def first(lever: tuple) -> str:
    return lever[0]


def tokens_per_step(args) -> int:
    return (DRY_SHAPE if args.dry_run else GPU_SHAPE)["tokens-per-step"]


def slice_args(args, case: dict, json_path: Path) -> list[str]:
    shape = DRY_SHAPE if args.dry_run else {**GPU_SHAPE, "layers": args.layers}
    command = [sys.executable, str(HERE / "moe_slice.py"), "--ep", str(case["ep"]), "--json", str(json_path),
               "--device", "cpu" if args.dry_run else "cuda"]
    command += [part for key, value in shape.items() for part in (f"--{key}", str(value))]
    for override in case["set"]:
        command += ["--set", override]
    if args.peak_tflops:
        command += ["--peak-tflops", str(args.peak_tflops)]
    if case.get("profile"):
        command += ["--profile", str(Path(args.out) / "profile_best")]
    return command


class Sweep:
    def __init__(self, args):
        self.args, self.out = args, Path(args.out)
        self.limits = LIMITS["dry" if args.dry_run else "gpu"]
        self.deadline = Deadline(args.deadline_s)
        self.reserve = 0.0  # seconds kept for the profile of the best case
        self.refused: dict[str, str] = {}  # lever -> this machine's refusal (the same at every EP)
        self.jsonl = self.out / "moe_perf.jsonl"
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        self.jsonl.write_text("")
        paths = [str(REPO)] + ([args.te_site] if args.te_site else []) + \
            [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))

    def record(self, row: dict) -> dict:
        with self.jsonl.open("a") as out:
            out.write(json.dumps(row, default=str) + "\n")
        moe_perf_report.write(self.out, self.args)
        status = row["status"] if row["status"] != "measured" else moe_perf_report.one_line(row)
        print(f"moe_perf: {row['phase']} {row['case']}: {status}", flush=True)
        return row

    def phase_a(self) -> None:
        limit = self.deadline.limit(self.limits["phase_a"], self.limits["min_case"])
        code = None
        if limit is not None:
            command = [sys.executable, str(HERE / "moe_perf_gemm.py"), "--jsonl", str(self.jsonl),
                       "--deadline-s", str(max(0.0, limit - 10))] + (["--dry-run"] if self.args.dry_run else [])
            code, _ = run_process(command, self.out / "logs" / "phase_a.log", limit, self.env)
        done = {row["case"] for row in moe_perf_report.read_rows(self.jsonl) if row["phase"] == "A"}
        why = (f"not run: {self.deadline.left():.0f} s left before the deadline" if limit is None else
               f"timed out: the phase's process was killed at its limit of {limit:g} s" if code is None else
               f"error: the phase's process exited with {code} (logs/phase_a.log)")
        for case in moe_perf_gemm.cases():
            if case["case"] not in done:
                self.record({**case, "status": why})
        moe_perf_report.write(self.out, self.args)

    def run_case(self, case: dict, baseline: dict | None = None) -> dict:
        """One case in its own process; its line (with the ratio and loss against `baseline`) once it ends."""
        row = {k: v for k, v in case.items() if k != "_levers"}
        row["set"] = [o.format(tokens_per_step=tokens_per_step(self.args)) for o in case["set"]]
        refused = config_refusal(row["set"])
        if refused:
            return self.record({**row, "status": f"refused by the config: {refused}"})
        if self.args.dry_run and not case["on_cpu"]:
            return self.record({**row, "status": "gpu-only: needs CUDA and Transformer Engine (not run on CPU)"})
        new = row["levers"][-1] if row["levers"] else None
        if new in self.refused:  # the builder's check of this machine, seen at the EP before: no process again
            return self.record({**row, "status": f"refused on this machine (at an EP before): {self.refused[new]}"})
        reserve = 0.0 if case.get("profile") else self.reserve
        limit = self.deadline.limit(self.limits["case"], self.limits["min_case"], reserve)
        if limit is None:
            kept = f", {reserve:.0f} s kept for the profile of the best case" if reserve else ""
            return self.record({**row, "status": f"not run: {max(0.0, self.deadline.left()):.1f} s left before the "
                                                 f"{self.args.deadline_s:g} s deadline{kept}"})
        slug = re.sub(r"[^A-Za-z0-9]+", "_", case["case"]).strip("_")
        report_path = self.out / "cases" / f"{slug}.json"
        report_path.parent.mkdir(exist_ok=True)
        report_path.unlink(missing_ok=True)
        log = self.out / "logs" / f"{slug}.log"
        code, seconds = run_process(slice_args(self.args, {**case, "set": row["set"]}, report_path), log, limit,
                                    self.env)
        row["seconds"] = seconds
        if code is None:
            return self.record({**row, "status": f"timed out: killed at its limit of {limit:g} s",
                                "log_tail": log_tail(log, 8)})
        if code != 0 or not report_path.exists():
            return self.record({**row, "status": f"error: exit {code}", "log_tail": log_tail(log, 8)})
        report = json.loads(report_path.read_text())
        if "refused" in report:  # a check against this machine, before the model was built
            if new and not case.get("fp8"):
                self.refused[new] = report["refused"]
            return self.record({**row, "status": f"refused on this machine: {report['refused']}"})
        row.update(report, status="measured")  # with the slice's config.json ("model"): the step-time table's key
        if baseline is not None:
            row.update(moe_perf_report.against(row, baseline))
        return self.record(row)

    def phase_b(self) -> None:
        ran = []  # (case, row)
        for ep in EPS:
            baseline_case = make_case(ep, f"EP{ep} baseline", [])
            baseline = self.run_case(baseline_case)
            pairs, kept = [(baseline_case, baseline)], []
            for lever in LEVERS:
                case = make_case(ep, f"EP{ep} + {lever[0]}", kept + [lever],
                                 without=[n for n, _, _ in LEVERS[:LEVERS.index(lever)] if n not in map(first, kept)])
                row = self.run_case(case, baseline)
                pairs.append((case, row))
                if moe_perf_report.measured(row) and row.get("loss_within_noise", True):
                    kept.append(lever)
            ran += pairs
            best = moe_perf_report.best([row for _, row in pairs])
            if best:
                case = fp8_case(ep, next(case for case, row in pairs if row is best))
                ran.append((case, self.run_case(case, baseline)))
            best = moe_perf_report.best([row for _, row in ran])
            self.reserve = PROFILE_RESERVE * best["seconds"] if best else 0.0
        best = moe_perf_report.best([row for _, row in ran])
        if best:
            case = next(case for case, row in ran if row is best)
            self.run_case({**case, "case": f"profile of '{best['case']}'", "profile": True})

    def wait_for_te(self) -> str | None:
        """Wait (within the deadline) for run.sh's background build of TE's extension; why not, or None."""
        if not self.args.te_build_rc:
            return None
        rc = Path(self.args.te_build_rc)
        while not rc.exists() and self.deadline.left() > self.limits["min_case"]:
            time.sleep(1)
        if not rc.exists():
            return "not run: Transformer Engine's extension was still building at the deadline"
        code = rc.read_text().strip()
        return None if code == "0" else f"not run: Transformer Engine's extension build failed (exit {code})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="results folder: moe_perf.jsonl, moe_perf.md, logs/")
    parser.add_argument("--dry-run", action="store_true", help="CPU, a tiny model: the pipeline, not GPU figures")
    parser.add_argument("--phases", default="AB", help="A, B or AB (default)")
    parser.add_argument("--deadline-s", type=float, help="global deadline in seconds (default: 450 on the GPU)")
    parser.add_argument("--peak-tflops", type=float, help="dense BF16 peak (default: from the GPU's name)")
    parser.add_argument("--layers", type=int, help="the slice's layers (default: up to 4, what the GPU's memory fits)")
    parser.add_argument("--te-site", help="the folder Transformer Engine is installed in (put on the cases' path)")
    parser.add_argument("--te-build-rc", help="file the background extension build writes its exit status to")
    args = parser.parse_args()
    if not set(args.phases) <= {"A", "B"} or not args.phases:
        parser.error(f"--phases {args.phases!r}: A, B or AB")
    check_lever_keys()
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA GPU is visible; on a CPU machine run with --dry-run")
        from gpu_verify_stages import slice_layers

        args.layers = args.layers or min(4, slice_layers(torch.cuda.get_device_properties(0).total_memory))
    args.deadline_s = args.deadline_s if args.deadline_s is not None else (float("inf") if args.dry_run else 450.0)
    sweep = Sweep(args)
    blocked = sweep.wait_for_te()
    if blocked:
        for case in moe_perf_gemm.cases() + [make_case(ep, f"EP{ep} baseline", []) for ep in EPS]:
            sweep.record({k: v for k, v in case.items() if k != "_levers"} | {"status": blocked})
        return 1
    if "A" in args.phases:
        sweep.phase_a()
    if "B" in args.phases:
        sweep.phase_b()
    moe_perf_report.write(sweep.out, args)
    print(f"moe_perf: results in {sweep.out / 'moe_perf.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
