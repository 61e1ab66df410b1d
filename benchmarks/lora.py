"""LoRA RL against full fine-tuning on the built-in default task, on paired seeds (docs/lora.md).

Everything runs through `megatron-rl` as a user runs it:

1. one warm start, `megatron-rl sft` for --warm-start supervised steps at --warm-seed (the tiny
   default's own warm start, full weights), converted to a Hugging Face model (`megatron-rl convert
   megatron-to-hf`) and shared by every seed and arm: the RL of both arms starts from the same
   policy (a LoRA run's in-train warm start would train only adapters on a random base), in the
   form a LoRA run's base usually comes in (`checkpoint.init_from` a megatron-rl checkpoint loads
   the same weights: the conversion is exact in fp32);
2. per seed, two arms from that checkpoint with the same seed (the same prompt stream and sampling
   seeds), --steps RL steps of the default recipe (DAPO), a checkpoint at the last step:
   `full` (every weight trains, optimizer.lr --full-lr: the default's) and `lora` (model.lora:
   rank --rank, alpha --alpha, every target the model has but the router; optimizer.lr --lora-lr,
   adapters take a larger rate).

Per arm and seed: the held-out accuracy (greedy, the whole held-out set) after the warm start
(step 0) and after RL, and the gain; from the last checkpoint's files, its bytes on disk and the
optimizer state's bytes (the Adam moments and any other `optimizer.` tensors the checkpoint
holds, read from its torch_dist metadata: what was written, not a formula); the median RL step time
(`time/step_s` of metrics.jsonl) and of the update alone (`time/train_s`). Printed and written as
ratios lora / full against the full fine-tuning measured in the same invocation, with the
goals: optimizer state <= 5%, checkpoint <= 5%, step time <= 1.2x, held-out gain >= 0.5x full's.
`megatron-rl plan --gpus 1 --json` of both arms is the cross-check of the optimizer bytes.

    .venv/bin/python benchmarks/lora.py                    # warm start + 3 seeds x 2 arms
    .venv/bin/python benchmarks/lora.py --seeds 2 --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from distill import cli, command_line, rows_of  # noqa: E402  (the benchmarks' shared run helpers)

ARMS = ("full", "lora")
# The goals: lora / full.
GOALS = {"optimizer_bytes": 0.05, "checkpoint_bytes": 0.05, "step_s": 1.2}
GAIN_GOAL = 0.5   # lora's held-out gain >= this x full's
# Per RL step, from metrics.jsonl: the whole step and its phases (generation, scoring and the
# weight sync do the same work in both arms; the old-logprob pass and the update differ).
TIMES = {"step_s": "time/step_s", "generate_s": "time/generate_s", "logprobs_s": "time/logprobs_s",
         "train_s": "time/train_s", "sync_s": "time/sync_s"}
TIME_LABELS = {"step_s": "RL step (`time/step_s`)", "step_s_p10": "RL step, 10th percentile (the least loaded)",
               "generate_s": "generation", "logprobs_s": "old-logprob pass", "train_s": "update",
               "sync_s": "weight sync"}


def arm_overrides(arm: str, args) -> list[str]:
    if arm == "full":
        return [f"optimizer.lr={args.full_lr}"]
    return [f"optimizer.lr={args.lora_lr}", f"model.lora.rank={args.rank}", f"model.lora.alpha={args.alpha}"]


def checkpoint_bytes(step_dir: Path) -> dict:
    """Bytes on disk of a checkpoint directory (every file), and of its optimizer state (every
    `optimizer.` tensor of each torch_dist `.metadata` under it): its elements' bytes (global shape x
    element size, what the optimizer holds) and the bytes stored for it (with torch.save's framing
    of each tensor)."""
    import math

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    optimizer = stored = tensors = 0
    for metadata in step_dir.rglob(".metadata"):
        read = FileSystemReader(str(metadata.parent)).read_metadata()
        for key, entry in read.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                size = math.prod(entry.size) * entry.properties.dtype.itemsize
                tensors += size
                optimizer += size if key.startswith("optimizer.") else 0
        stored += sum(info.length for index, info in read.storage_data.items() if index.fqn.startswith("optimizer."))
    if not tensors:
        raise SystemExit(f"{step_dir}: no torch_dist tensors found (is this a megatron-rl checkpoint?)")
    files = [p for p in step_dir.rglob("*") if p.is_file()]
    return {"checkpoint_bytes": sum(p.stat().st_size for p in files), "optimizer_bytes": optimizer,
            "optimizer_stored_bytes": stored, "tensor_bytes": tensors}


# Where `megatron-rl plan` counts the optimizer state: the tiny default on one GPU (the runs' own
# model and layout), and a real MoE on 4 GPUs in bf16 (data parallel, distributed optimizer).
PLANS = {"tiny default, 1 GPU": ["--gpus", "1"],
         "Qwen3-30B-A3B, 4 GPUs, bf16": ["--gpus", "4", "--hf-config", "qwen3-30b-a3b", "model.precision=bf16"]}


def planned_optimizer_bytes(arm: str, args, plan_args: list[str]) -> int:
    """`megatron-rl plan`'s optimizer state (Adam's moments and fp32 main weights) per GPU of the
    arm's model, the config's own layout."""
    command = [sys.executable, "-m", "megatron_rl.cli", "plan", "--json", *plan_args, "device=cuda",
               *arm_overrides(arm, args)]
    result = subprocess.run(command, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True)
    if result.returncode not in (0, 3):  # 3: no layout fits these GPUs (full fine-tuning of 30B on 4), still planned
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
    stages = json.loads(result.stdout)["config_layout"]["stages"]
    return sum(stage["moments_bytes"] + stage["main_params_bytes"] for stage in stages)


def summarize_run(rows: list[dict]) -> dict:
    """A run's metrics.jsonl rows -> held-out accuracy at step 0 and at its last evaluation, and
    the median step times of its RL steps."""
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    if not evals or evals[0][0] != 0:
        raise SystemExit("the run has no held-out evaluation at step 0 (after the warm start)")
    steps = [r for r in rows if r.get("step", 0) >= 1 and "time/step_s" in r]
    times = {key: statistics.median(r.get(metric, 0.0) for r in steps) for key, metric in TIMES.items()}
    ordered = sorted(r["time/step_s"] for r in steps)
    return {"start": evals[0][1], "final": evals[-1][1], "final_step": evals[-1][0],
            "gain": evals[-1][1] - evals[0][1], **times, "step_s_p10": ordered[len(ordered) // 10]}


def run_arm(root: Path, arm: str, seed: int, warm: Path, args) -> dict:
    from megatron_rl.checkpoint.format import resolve_checkpoint

    run = root / f"{arm}_seed{seed}"
    load_before = os.getloadavg()[0]
    _, wall = cli("train", "--output-dir", str(run), "logging.wandb_mode=disabled", "checkpoint.export_hf=false",
                  "checkpoint.every_steps=0", "checkpoint.keep_last=1", f"checkpoint.init_from={warm}",
                  "warm_start.steps=0", f"seed={seed}", f"rl.steps={args.steps}", f"rl.eval_every={args.steps}",
                  *arm_overrides(arm, args))
    # the machine's load (1-minute average) around the run: its step times are only as good as that
    load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    latest = resolve_checkpoint(run)
    base = json.loads((latest / "megatron_rl.json").read_text()).get("base")
    return {"arm": arm, "seed": seed, "wall_s": wall, "loadavg": load, **summarize_run(rows_of(run)),
            **checkpoint_bytes(latest), "base_kind": base and base["kind"]}  # the run's latest step


def summarize(runs: list[dict]) -> dict:
    """Per arm the means over seeds; lora / full ratios and whether each goal is met."""
    mean = {arm: {key: statistics.fmean(r[key] for r in runs if r["arm"] == arm)
                  for key in ("start", "final", "gain", "optimizer_bytes", "checkpoint_bytes", "tensor_bytes")}
            for arm in ARMS}
    for arm in ARMS:  # times: the median of the arm's per-run medians (a loaded machine makes outliers)
        for key in TIME_LABELS:
            mean[arm][key] = statistics.median(r[key] for r in runs if r["arm"] == arm)
    ratios = {key: mean["lora"][key] / mean["full"][key] if mean["full"][key] else None
              for key in ("optimizer_bytes", "checkpoint_bytes", "tensor_bytes", *TIME_LABELS)}
    full_gain = mean["full"]["gain"]
    ratios["gain"] = mean["lora"]["gain"] / full_gain if full_gain > 0 else None
    met = {key: ratios[key] <= goal for key, goal in GOALS.items()}
    met["gain"] = ratios["gain"] is not None and ratios["gain"] >= GAIN_GOAL
    return {"mean": mean, "ratios": ratios, "met": met}


def _mib(value: float) -> str:
    return f"{value / 2**20:.2f} MiB"


def report(runs: list[dict], summary: dict, plan: dict, args, wall: float) -> str:
    mean, ratios, met = summary["mean"], summary["ratios"], summary["met"]
    verdict = {True: "met", False: "**not met**"}
    lines = [
        "# LoRA vs full fine-tuning in RL (benchmarks/lora.py)",
        "",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}; total {wall / 60:.1f} min.",
        f"Command: `python benchmarks/lora.py {command_line(sys.argv[1:])}`",
        "",
        f"One warm start for every run: `megatron-rl sft` of the built-in default, {args.warm_start} steps, seed "
        f"{args.warm_seed}. Then per seed {args.steps} RL steps (the default recipe, DAPO) of each arm from it, "
        f"same seed: **full** (every weight, optimizer.lr {args.full_lr}) and **lora** (model.lora rank {args.rank}, "
        f"alpha {args.alpha}, every target but the router; optimizer.lr {args.lora_lr}). Held-out accuracy: greedy, "
        "the whole held-out set, at step 0 and after the last step. Bytes: the last checkpoint (written at the "
        "last step), every file; its optimizer state: the `optimizer.` tensors of its torch_dist metadata, global "
        "shape x element size (stored with torch.save's framing: the JSON's `optimizer_stored_bytes`). A LoRA "
        "checkpoint refers to its frozen base (here the warm start's HF directory, `checkpoint.init_from`) by path "
        "and checksums instead of holding it (`checkpoint.base_weights: referenced`, the default): "
        f"{'the base is not counted' if all(r.get('base_kind') for r in runs if r['arm'] == 'lora') else 'NOT all LoRA checkpoints referred to their base'}.",
        "",
        "| seed | arm | held-out after warm start | after RL | gain | median step s | median update s "
        "| optimizer state | checkpoint on disk | load average before, after |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        lines.append(f"| {r['seed']} | {r['arm']} | {r['start']:.3f} | {r['final']:.3f} | {r['gain']:+.3f} | "
                     f"{r['step_s']:.2f} | {r['train_s']:.2f} | {_mib(r['optimizer_bytes'])} | "
                     f"{_mib(r['checkpoint_bytes'])} | {r['loadavg'][0]:.1f}, {r['loadavg'][1]:.1f} |")
    gain_ratio = "n/a (full fine-tuning did not gain)" if ratios["gain"] is None else f"{ratios['gain']:.2f}"
    lines += [
        "",
        "| figure (mean over seeds; step times: median of the per-run medians) | full | lora | lora / full | goal |",
        "| --- | --- | --- | --- | --- |",
        f"| optimizer state | {_mib(mean['full']['optimizer_bytes'])} | {_mib(mean['lora']['optimizer_bytes'])} | "
        f"{ratios['optimizer_bytes']:.4f} | <= 0.05: {verdict[met['optimizer_bytes']]} |",
        f"| checkpoint on disk | {_mib(mean['full']['checkpoint_bytes'])} | {_mib(mean['lora']['checkpoint_bytes'])} | "
        f"{ratios['checkpoint_bytes']:.4f} | <= 0.05: {verdict[met['checkpoint_bytes']]} |",
        f"| checkpoint tensors (torch_dist, every tensor) | {_mib(mean['full']['tensor_bytes'])} | "
        f"{_mib(mean['lora']['tensor_bytes'])} | {ratios['tensor_bytes']:.4f} |  |",
        *[f"| {label} | {mean['full'][key]:.3f} s | {mean['lora'][key]:.3f} s | "
          + ("n/a" if ratios[key] is None else f"{ratios[key]:.2f}") + " | "
          + (f"<= 1.2: {verdict[met['step_s']]}" if key == "step_s" else "") + " |"
          for key, label in TIME_LABELS.items()],
        f"| held-out gain | {mean['full']['gain']:+.3f} | {mean['lora']['gain']:+.3f} | {gain_ratio} | "
        f">= 0.5: {verdict[met['gain']]} |",
        "",
    ]
    if plan:
        lines += ["`megatron-rl plan`'s optimizer state per GPU (Adam's moments and fp32 main weights; the same "
                  "model.lora and arms), the cross-check of the tiny default's and the same adapters on a real MoE:",
                  "", "| model, layout | full | lora | lora / full |", "| --- | --- | --- | --- |"]
        lines += [f"| {name} | {_mib(value['full'])} | {_mib(value['lora'])} | {value['lora'] / value['full']:.4f} |"
                  for name, value in plan.items()]
    return "\n".join(lines) + "\n"


def write_results(runs: list[dict], plan: dict, args, started: float) -> dict:
    summary = summarize(runs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report(runs, summary, plan, args, time.perf_counter() - started))
    settings = {k: v for k, v in vars(args).items() if k not in ("work", "out")}
    out.with_suffix(".json").write_text(json.dumps({"runs": runs, "summary": summary, "plan": plan,
                                                    "settings": settings}, indent=1))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40, help="RL steps of each arm")
    parser.add_argument("--warm-start", type=int, default=250, help="the shared warm start's supervised steps")
    parser.add_argument("--warm-seed", type=int, default=1234, help="the warm start's seed (the default's)")
    parser.add_argument("--full-lr", type=float, default=5.0e-4, help="full fine-tuning's rate (the default's)")
    parser.add_argument("--lora-lr", type=float, default=2.0e-3, help="the adapters' rate")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--no-plan", action="store_true", help="skip the planner's cross-check")
    parser.add_argument("--work", help="where the runs go (default: a temporary directory, removed)")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/lora_cpu.md"))
    args = parser.parse_args()
    started = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as scratch:
        root = Path(args.work or scratch)
        root.mkdir(parents=True, exist_ok=True)
        plan = {} if args.no_plan else {name: {arm: planned_optimizer_bytes(arm, args, plan_args) for arm in ARMS}
                                        for name, plan_args in PLANS.items()}
        warm = root / "warm_start_hf"
        if not warm.exists():
            sft = root / "warm_start"
            cli("sft", "--output-dir", str(sft), f"warm_start.steps={args.warm_start}", f"seed={args.warm_seed}")
            cli("convert", "megatron-to-hf", "--ckpt", str(sft), "--out", str(warm))
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            # the arms of a seed back to back (about the same machine load), taking turns to go first
            for arm in (ARMS if seed % 2 else ARMS[::-1]):
                runs.append(run_arm(root, arm, seed, warm, args))
                r = runs[-1]
                print(f"seed {seed} {arm}: held-out {r['start']:.3f} -> {r['final']:.3f}, step {r['step_s']:.2f} s, "
                      f"optimizer {_mib(r['optimizer_bytes'])}, checkpoint {_mib(r['checkpoint_bytes'])} "
                      f"({r['wall_s']:.0f} s)", flush=True)
            summary = write_results(runs, plan, args, started)  # after every seed: a stopped run keeps its seeds
    for key, value in summary["ratios"].items():
        print(f"lora / full {key}: {'n/a' if value is None else f'{value:.4f}'}"
              + (f" (goal: {'met' if summary['met'][key] else 'NOT MET'})" if key in summary["met"] else ""))
    print(f"report {args.out}")


if __name__ == "__main__":
    main()
