"""The GPU engine stage: the RL step end to end with the policy on CUDA and vLLM on the same GPU.

    python benchmarks/gpu_engine.py --out DIR [--deadline-s 420] [--checks push,server]   # on the GPU
    python benchmarks/gpu_engine.py --out DIR --dry-run [--server-url URL]                # on CPU

Checks, in order of value (benchmarks/gpu_engine_sync.py, gpu_engine_fp8_r3.py, gpu_engine_train.py):
  push       fp32 policy and fp32 colocated engine: the bridge's bucket stream in process; after
             every push the engine's logprobs of the step's samples equal the trainer's (<= 1e-4)
  colocated  BF16 policy and engine in one process, each holding its share of the GPU; vLLM's
             sleep mode around training (rollout.sleep_level 1, then 2, one engine): free GPU memory
             while training with the engine awake and asleep at each level; logprobs after every
             push (each wake's included) within the stated bf16 bound
  server     rollout.mode=server: one vLLM HTTP server on the same GPU taking the files transport
  r3         rl.routing_replay=rollout: the engine's routed experts replayed by the trainer
  learns     `megatron-rl train`, the tiny default recipe for a short run: held-out accuracy before
             and after, step phases in seconds, against the same run on CPU
  fp8        model.export_fp8 into a block-FP8 vLLM engine: logprobs against a BF16 engine and the
             trainer, and what rl.off_policy's corrections do with the difference

Engines start from a local config and tokenizer with dummy weights and take the trainer's push
(weights cannot travel to the GPU machine). Every check runs in its own process, with its own time
limit, and none starts once --deadline-s is passed ("deadline"); DIR/gpu_engine.json and .md are
written after every check, so a killed run keeps what it did. The dry run (--dry-run) runs every
check's code that can run on CPU with vLLM's CPU build; what needs a GPU is recorded as
"gpu-only: <reason>".
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
    "push": "engine == trainer logprobs after every push (fp32, colocated, in-process bucket stream)",
    "colocated": "policy and engine on one GPU: sleep levels 1 and 2 around training, free memory, bf16 logprobs",
    "server": "a vLLM server on the same GPU taking the files transport",
    "r3": "R3: the engine's routed experts replayed by the trainer",
    "learns": "megatron-rl train, the tiny default: held-out accuracy, step phases vs CPU",
    "fp8": "FP8 rollout: block-FP8 engine vs BF16 engine vs trainer, and rl.off_policy",
}
# Seconds per check on one H100/H200: a vLLM start (CUDA graphs, torch.compile) is 30-60 s of each.
# run.sh gives the stage what is left of its command as --deadline-s.
# What does not fit one command (the default 420 s reach about learns) runs in a second call:
# --checks learns,fp8.
TIMEOUTS = {"push": 110, "colocated": 110, "server": 120, "r3": 100, "learns": 200, "fp8": 150}
# The dry run's only guard against a hang: a shared 2-core machine can be slow by several times.
DRY_RUN_TIMEOUTS = {name: 600 for name in TITLES}


def run_check(name: str, args, budget: float) -> dict:
    """One check in its own process (and process group: a timeout ends its engines too)."""
    command = [sys.executable, __file__, "--child", name, "--out", args.out, "--device", args.device]
    command += ["--server-url", args.server_url] if args.server_url else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))
    out = Path(args.out)
    return run_child(command, env, out / "logs" / f"{name}.log", out / "checks" / f"{name}.json", budget, "check's")


def child(name: str, args) -> int:
    """The check's own process: its report, or its error with the traceback's last lines."""
    import gpu_engine_fp8_r3
    import gpu_engine_sync
    import gpu_engine_train

    checks = {"push": gpu_engine_sync.check_push, "colocated": gpu_engine_sync.check_colocated,
              "server": gpu_engine_sync.check_server, "learns": gpu_engine_train.check_learns,
              "r3": gpu_engine_fp8_r3.check_r3, "fp8": gpu_engine_fp8_r3.check_fp8}
    options = {"out_dir": args.out, "server_url": args.server_url}
    try:
        report = checks[name](args.device, options)
    except Exception as exc:  # recorded in the results; the next check runs
        report = error_report(exc)
    (Path(args.out) / "checks" / f"{name}.json").write_text(json.dumps(report, indent=1, default=str))
    sys.stdout.flush()
    os._exit(0)  # engines' and process groups' teardown at exit can hang; the report is written


def write_results(args, results: dict, started: float) -> None:
    out = Path(args.out)
    data = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv).replace(f"{REPO}/", ""), "device": args.device, "dry_run": args.dry_run,
            "gpu": gpu_name(args.device), "seconds": round(time.perf_counter() - started, 1), "checks": results}
    (out / "gpu_engine.json").write_text(json.dumps(data, indent=1, default=str))
    (out / "gpu_engine.md").write_text(markdown(data))


def gpu_name(device: str) -> str:
    if device != "cuda":
        import platform

        import torch

        return (f"none (dry run on CPU, {os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}: "
                f"vLLM's CPU build stands in for the GPU engine)")
    import torch

    props = torch.cuda.get_device_properties(0)
    return f"{props.name}, {props.total_memory / 2**30:.1f} GiB, torch {torch.__version__}"


def markdown(data: dict) -> str:
    lines = [f"# GPU engine stage: {data['gpu']}", "",
             f"{data['date']}, `{data['command']}`, {data['seconds']:.0f} s in all.", "",
             "| check | what | status | seconds |", "| --- | --- | --- | --- |"]
    lines += [f"| {name} | {TITLES[name]} | {r['status']} | {r.get('seconds', 0):.0f} |" for name, r in data["checks"].items()]
    for name, result in data["checks"].items():
        lines += ["", f"## {name}: {result['status']}", "", TITLES[name], ""]
        for key, value in result.get("figures", {}).items():
            lines.append(f"- {key}: {json.dumps(value) if isinstance(value, (dict, list)) else value}")
        for part, reason in result.get("gpu_only", {}).items():
            lines.append(f"- {part}: gpu-only: {reason}")
        lines += check_lines(result)
    return "\n".join(lines) + "\n"


def parse_checks(parser, text: str | None) -> list[str]:
    names = list(TITLES) if not text else [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in TITLES]
    if unknown or not names:
        parser.error(f"--checks {text!r}: {', '.join(unknown) or 'none given'}; choose from {','.join(TITLES)}")
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="results folder: gpu_engine.md, gpu_engine.json, logs/, checks/")
    parser.add_argument("--dry-run", action="store_true", help="on CPU with vLLM's CPU build (GPU-only parts recorded)")
    parser.add_argument("--checks", help=f"comma-separated, in the order to run (default: {','.join(TITLES)})")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="no check starts after this many seconds, none runs past it (default: 420 on the GPU, "
                             "none in a dry run)")
    parser.add_argument("--server-url", help="dry run: the server check pushes into this running vLLM server of the "
                                             "tiny default model instead of starting one")
    parser.add_argument("--device", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args)
    names = parse_checks(parser, args.checks)
    if args.server_url and not args.dry_run:
        parser.error("--server-url is for the dry run (on the GPU the server check starts its own server)")
    args.device = "cpu" if args.dry_run else "cuda"
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA GPU is visible; on a CPU machine run with --dry-run")
    if args.deadline_s is None:
        args.deadline_s = float("inf") if args.dry_run else 420.0
    timeouts = DRY_RUN_TIMEOUTS if args.dry_run else TIMEOUTS
    Path(args.out).mkdir(parents=True, exist_ok=True)
    started, results = time.perf_counter(), {}
    for name in names:
        left = args.deadline_s - (time.perf_counter() - started)
        if left < 1:
            results[name] = {"status": "deadline", "error": f"not started: the {args.deadline_s:g} s deadline had passed"}
        else:
            results[name] = run_check(name, args, min(timeouts[name], left))
        print(f"gpu_engine: {name}: {results[name]['status']} in {results[name].get('seconds', 0):.0f} s", flush=True)
        write_results(args, results, started)
    print(f"gpu_engine: results in {Path(args.out) / 'gpu_engine.md'}", flush=True)
    return 0 if all(r["status"] == "passed" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
