"""The GPU verification kit's checks: stage by stage, each in its own process with its own time limit.

    bash scripts/gpu_kit/run.sh RESULTS_DIR            # on the GPU machine: installs the kit, then this
    bash scripts/gpu_kit/run.sh --dry-run RESULTS_DIR  # stages a-c on CPU, the same code (the suite runs it)
    python benchmarks/gpu_verify.py --out DIR [--dry-run] [--stages abc] [--timeout b=90] [--deadline-s 520]

Stages (benchmarks/gpu_verify_stages.py):
  a  versions: torch, CUDA, cuDNN, NCCL, Transformer Engine, megatron-core; GPU name and memory;
     the pruned TE core library loads (its own process: a-c run without TE on their path)
  b  the tiny MoE policy's step (TP1) on the GPU vs on the CPU, fp32 with TF32 off, then bf16:
     logprobs, loss, grad norm, the update, against stated tolerances
  c  FP8 export (bridge/fp8_export.py) on the GPU vs the CPU: scales and values bit for bit
  d  Transformer Engine: the project's FP8 verdicts and TE's own; te.Linear forward/backward under
     delayed, current and blockwise scaling vs BF16
  e  the TE layer spec end to end (benchmarks/fp8_moe.py): a MoE with grouped-GEMM experts, BF16 vs
     each FP8 recipe this GPU runs, 20 steps: loss difference, tokens/s, MFU, peak memory
  f  a Qwen3-30B-A3B-shaped slice (as many layers as fit), BF16 vs blockwise FP8: MFU with the MoE
     layers' time apart from the output head's, tokens/s, memory
Stages d-f need Transformer Engine's PyTorch extension, which run.sh builds in the background while
a-c run; they wait for it (within their own time).

RESULTS_DIR/gpu_verify.md and gpu_verify.json are rewritten after every stage, so a run killed at
any point keeps what it had; a failed or timed-out stage is recorded with its error and the next
stage runs. Each stage's output is in RESULTS_DIR/logs/<stage>.log.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from check_process import check_lines, error_report, run_child  # noqa: E402  (benchmarks/ is on sys.path)

TITLES = {
    "a": "versions, GPU",
    "b": "tiny MoE policy step: device vs CPU (fp32 TF32 off, bf16)",
    "c": "FP8 export: device vs CPU, bit for bit",
    "d": "Transformer Engine: FP8 verdicts, te.Linear per recipe vs BF16",
    "e": "TE layer spec end to end: BF16 vs each FP8 recipe, 20 steps",
    "f": "Qwen3-30B-A3B-shaped slice: BF16 vs blockwise FP8, MoE layers apart from the head",
}
# Seconds per stage on the GPU machine. The whole run (install and extension build included) must fit
# one 9-minute command: run.sh passes what is left as --deadline-s and no stage runs past it.
TIMEOUTS = {"a": 60, "b": 120, "c": 60, "d": 240, "e": 150, "f": 180}
# The dry run's limits only guard against a hang: a shared CPU machine can be slow by several times.
DRY_RUN_TIMEOUTS = {"a": 180, "b": 480, "c": 300}
NEEDS_TE = {"d", "e", "f"}
NOT_SHOWN = ("TP, PP or EP above 1 and NCCL between ranks (one GPU; NCCL refuses two ranks on one GPU); "
             "vLLM and SGLang engines, FP8 rollout engines and R3 through an engine (their wheels cannot reach "
             "the GPU machine)")


def stage_env(stage: str, te_site: str | None) -> dict:
    """PYTHONPATH for a stage: the repository, and Transformer Engine only for d-f (a-c run while
    its extension is still being built, and megatron-core must not see a half-installed TE)."""
    paths = [str(REPO)] + ([te_site] if te_site and stage in NEEDS_TE else []) + \
        [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


def run_stage(stage: str, args, budget: float) -> dict:
    """One stage in its own process (and process group: a timeout ends its children too)."""
    command = [sys.executable, __file__, "--child", stage, "--out", args.out, "--device", args.device,
               "--timeout", f"{stage}={budget}"] + (["--te-build-rc", args.te_build_rc] if args.te_build_rc else []) \
        + (["--te-site", args.te_site] if args.te_site else [])
    out = Path(args.out)
    return run_child(command, stage_env(stage, args.te_site), out / "logs" / f"{stage}.log",
                     out / "stages" / f"{stage}.json", budget, "stage")


def child(stage: str, args) -> int:
    """The stage's own process: its report, or its error with the traceback's last lines."""
    import gpu_verify_stages as stages

    options = {"out_dir": args.out, "timeout_s": parse_timeouts(args.timeout).get(stage, TIMEOUTS[stage]),
               "te_build_rc": args.te_build_rc, "te_site": args.te_site}
    report_path = Path(args.out) / "stages" / f"{stage}.json"
    try:
        if stage in NEEDS_TE:
            stages.wait_for_te_build(options)
        report = stages.STAGES[stage](args.device, options)
    except Exception as exc:  # recorded in the results; the next stage runs
        report = error_report(exc)
    report_path.write_text(json.dumps(report, indent=1, default=str))
    return 0


def parse_timeouts(items: list[str]) -> dict[str, float]:
    timeouts = {}
    for item in items:
        stage, _, seconds = item.partition("=")
        if stage not in TITLES or not seconds:
            raise SystemExit(f"--timeout {item!r}: expected STAGE=SECONDS with STAGE one of {''.join(TITLES)}")
        timeouts[stage] = float(seconds)
    return timeouts


def write_results(args, results: dict, started: float) -> None:
    out = Path(args.out)
    data = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv).replace(f"{REPO}/", ""), "device": args.device, "dry_run": args.dry_run,
            "seconds": time.perf_counter() - started, "stages": results, "not_shown_on_one_gpu": NOT_SHOWN}
    (out / "gpu_verify.json").write_text(json.dumps(data, indent=1, default=str))
    (out / "gpu_verify.md").write_text(markdown(data))


def markdown(data: dict) -> str:
    versions = data["stages"].get("a", {}).get("figures", {})
    where = "CPU dry run (stages a-c; the device under test is the CPU)" if data["dry_run"] else versions.get("GPU", "GPU")
    lines = [f"# GPU verification: {where}", "",
             f"{data['date']}, `{data['command']}`, {data['seconds']:.0f} s in all.", "",
             "| stage | what | status | seconds |", "| --- | --- | --- | --- |"]
    lines += [f"| {s} | {TITLES[s]} | {r['status']} | {r.get('seconds', 0):.0f} |" for s, r in data["stages"].items()]
    for stage, result in data["stages"].items():
        lines += ["", f"## {stage}. {TITLES[stage]}: {result['status']}", ""]
        for name, value in result.get("figures", {}).items():
            lines.append(f"- {name}: {json.dumps(value) if isinstance(value, (dict, list)) else value}")
        lines += check_lines(result)
    lines += ["", f"Not shown by this kit on one GPU: {data['not_shown_on_one_gpu']}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="results folder: gpu_verify.md, gpu_verify.json, logs/")
    parser.add_argument("--dry-run", action="store_true", help="stages a-c on CPU (the device under test is the CPU)")
    parser.add_argument("--stages", help="which stages, e.g. abc (default: a-f, or a-c with --dry-run)")
    parser.add_argument("--timeout", action="append", default=[], metavar="STAGE=SECONDS",
                        help=f"a stage's time limit (defaults: {TIMEOUTS})")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="no stage runs past this many seconds (default: 540 on the GPU, none in a dry run)")
    parser.add_argument("--te-site", help="the folder Transformer Engine is installed in (put on d-f's path)")
    parser.add_argument("--te-build-rc", help="file the background extension build writes its exit status to")
    parser.add_argument("--device", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args)
    args.device = "cpu" if args.dry_run else "cuda"
    stages = args.stages or ("abc" if args.dry_run else "".join(TITLES))
    unknown = sorted(set(stages) - set(TITLES))
    if unknown or (args.dry_run and set(stages) & NEEDS_TE):
        parser.error(f"--stages {stages!r}: choose from a-f; a dry run runs a-c only (d-f need a GPU and TE)")
    timeouts = {**TIMEOUTS, **(DRY_RUN_TIMEOUTS if args.dry_run else {}), **parse_timeouts(args.timeout)}
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA GPU is visible; on a CPU machine run with --dry-run")
    if args.deadline_s is None:
        args.deadline_s = float("inf") if args.dry_run else 540.0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    started, results = time.perf_counter(), {}
    for stage in stages:
        left = args.deadline_s - (time.perf_counter() - started)
        if left < 1:
            results[stage] = {"status": "not run", "error": f"no time left before the {args.deadline_s:g} s deadline"}
        else:
            results[stage] = run_stage(stage, args, min(timeouts[stage], left))
        print(f"gpu_verify: {stage} ({TITLES[stage]}): {results[stage]['status']}"
              f" in {results[stage].get('seconds', 0):.0f} s", flush=True)
        write_results(args, results, started)
    print(f"gpu_verify: results in {Path(args.out) / 'gpu_verify.md'}")
    return 0 if all(r["status"] == "passed" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
