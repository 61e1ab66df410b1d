"""On-policy distillation against RL alone on the built-in default task, on paired seeds.

Everything runs through `megatron-rl` as a user runs it:

1. the teacher: the built-in default run (warm start, then DAPO for --teacher-steps RL steps),
   exported as a Hugging Face model; its held-out accuracy is that run's last evaluation (and,
   with --mode server, measured again by the distillation runs at their start: `teacher/accuracy`);
2. the student: a fresh warm start, `megatron-rl sft` for --student-warm-start supervised steps at
   --student-seed (by default the teacher's own: the student is the policy the teacher's RL started
   from), written once and shared by every seed and arm (the warm start's outcome depends strongly
   on the initialization seed: 0.41 held-out at seed 1234, 0.07 at seeds 1-3, 250 steps);
3. per seed, two arms from that checkpoint with the same seed (the same prompt stream and
   sampling seeds): RL alone (the default recipe, DAPO) and distillation alone (rl.teacher: the
   teacher, rl.distill_coef: 1; the reward functions still score, for the metrics and the
   held-out accuracy, but never enter the loss). --per-seed-warm-start: one warm start per seed,
   at that seed, instead.

Per arm and seed: the held-out accuracy (greedy, the whole held-out set) every --eval-every
steps, against RL steps and against samples generated (dynamic sampling's refills counted), and
the first step at which it reaches --target x the teacher's held-out accuracy. Printed: per seed
the steps of both arms and the ratio distillation / RL; over the seeds the mean steps and their
ratio (the goal: below 1). An arm that never reaches the target counts its step budget + 1 and is
named. Writes a markdown report, the JSON of every curve and a PNG.

    .venv/bin/python benchmarks/distill.py            # teacher + 3 seeds x 2 arms, ~12 min on 2 cores
    .venv/bin/python benchmarks/distill.py --teacher RUN --seeds 5   # a teacher run this script trained before
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
COMMON = ["logging.wandb_mode=disabled", "checkpoint.every_steps=0"]


def cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    command = [sys.executable, "-m", "megatron_rl.cli", *args]
    started = time.perf_counter()
    result = subprocess.run(command, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{(result.stdout + result.stderr)[-4000:]}")
    return result, time.perf_counter() - started


def rows_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train_teacher(root: Path, args) -> dict:
    run = root / "teacher"
    _, wall = cli("train", "--output-dir", str(run), *COMMON, f"rl.steps={args.teacher_steps}",
                  f"rl.eval_every={args.teacher_steps}", f"seed={args.teacher_seed}")
    evals = [r for r in rows_of(run) if "eval/accuracy" in r]
    return {"hf_model": str(run / "hf_model"), "accuracy_after_warm_start": evals[0]["eval/accuracy"],
            "accuracy": evals[-1]["eval/accuracy"], "rl_steps": args.teacher_steps, "wall_s": wall}


def student_warm_start(root: Path, seed: int, args) -> Path:
    out = root / f"student_seed{seed}"
    if not out.exists():
        cli("sft", "--output-dir", str(out), f"warm_start.steps={args.student_warm_start}", f"seed={seed}")
    return out


def arm_overrides(arm: str, teacher: dict, args) -> list[str]:
    if arm == "rl":
        return []
    return [f"rl.teacher.source={teacher['hf_model']}", f"rl.teacher.mode={args.mode}", "rl.distill_coef=1"]


def run_arm(root: Path, arm: str, seed: int, warm: Path, teacher: dict, args) -> dict:
    run = root / f"{arm}_seed{seed}"
    _, wall = cli("train", "--output-dir", str(run), *COMMON, "checkpoint.export_hf=false",
                  f"checkpoint.init_from={warm}", "warm_start.steps=0", f"seed={seed}", f"rl.steps={args.steps}",
                  f"rl.eval_every={args.eval_every}", *arm_overrides(arm, teacher, args))
    rows = rows_of(run)
    generated, samples_at = 0, {0: 0}
    for row in rows:
        if row["step"] >= 1:
            generated += row.get("rollout/groups_generated", 0) * args.group_size
            samples_at[row["step"]] = generated
    curve = [(r["step"], samples_at.get(r["step"], 0), r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    extra = {}
    teacher_row = next((r for r in rows if "teacher/accuracy" in r), None)
    if teacher_row is not None:
        extra["teacher_accuracy_measured"] = teacher_row["teacher/accuracy"]
    kl = [(r["step"], r["distill/reverse_kl"]) for r in rows if "distill/reverse_kl" in r]
    return {"arm": arm, "seed": seed, "curve": curve, "reverse_kl": kl, "wall_s": wall, **extra}


def first_reaching(curve: list[tuple[int, int, float]], target: float, budget: int) -> tuple[int, int | None]:
    """(step, samples) of the first evaluation at or above `target`; (budget + 1, None) if none."""
    for step, samples, accuracy in curve:
        if accuracy >= target:
            return step, samples
    return budget + 1, None


def summarize(runs: list[dict], teacher: dict, args) -> dict:
    target = args.target * teacher["accuracy"]
    per_seed = []
    for seed in args.seed_list:
        pair = {run["arm"]: run for run in runs if run["seed"] == seed}
        steps = {arm: first_reaching(pair[arm]["curve"], target, args.steps) for arm in ("rl", "distill")}
        per_seed.append({"seed": seed, "start": pair["rl"]["curve"][0][2],
                         "rl_steps": steps["rl"][0], "distill_steps": steps["distill"][0],
                         "rl_samples": steps["rl"][1], "distill_samples": steps["distill"][1],
                         "rl_final": pair["rl"]["curve"][-1][2], "distill_final": pair["distill"]["curve"][-1][2],
                         "ratio": steps["distill"][0] / steps["rl"][0]})
    mean = {key: statistics.fmean(s[key] for s in per_seed) for key in ("rl_steps", "distill_steps", "rl_final",
                                                                       "distill_final")}
    return {"target": target, "per_seed": per_seed, "mean": mean,
            "ratio_of_means": mean["distill_steps"] / mean["rl_steps"],
            "distill_faster_in": sum(s["distill_steps"] < s["rl_steps"] for s in per_seed)}


def plot(runs: list[dict], teacher: dict, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"rl": "tab:blue", "distill": "tab:orange"}
    labels = {"rl": "RL alone (DAPO)", "distill": "distillation alone"}
    for run in runs:
        steps = [s for s, _, _ in run["curve"]]
        samples = [n for _, n, _ in run["curve"]]
        accuracy = [a for _, _, a in run["curve"]]
        label = labels[run["arm"]] if run["seed"] == runs[0]["seed"] else None
        axes[0].plot(steps, accuracy, color=colors[run["arm"]], alpha=0.8, marker=".", label=label)
        axes[1].plot(samples, accuracy, color=colors[run["arm"]], alpha=0.8, marker=".", label=label)
    for axis, xlabel in zip(axes, ("RL step", "samples generated")):
        axis.axhline(teacher["accuracy"], color="black", linestyle="--", label="teacher")
        axis.axhline(summary["target"], color="grey", linestyle=":", label="target (0.9 x teacher)")
        axis.set_xlabel(xlabel)
        axis.set_ylabel("held-out accuracy (greedy)")
        axis.grid(alpha=0.3)
    axes[0].legend(loc="lower right")
    figure.suptitle("on-policy distillation vs RL alone, built-in default task, paired seeds")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def command_line(argv: list[str]) -> str:
    """The arguments as run, with this machine's paths (--teacher, --work, --out) named by role."""
    placeholders = {"--teacher": "TEACHER_RUN", "--work": "WORK_DIR", "--out": "REPORT.md"}
    shown, hide = [], None
    for arg in argv:
        name = arg.split("=", 1)[0]
        if hide is not None:
            shown.append(placeholders[hide])
            hide = None
        elif name in placeholders and "=" in arg:
            shown.append(f"{name}={placeholders[name]}")
        else:
            shown.append(arg)
            hide = name if name in placeholders else None
    return " ".join(shown)


def report(teacher: dict, runs: list[dict], summary: dict, args, png: Path, wall: float) -> str:
    lines = [
        "# On-policy distillation vs RL alone (benchmarks/distill.py)",
        "",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}; total {wall / 60:.1f} min.",
        f"Command: `python benchmarks/distill.py {command_line(sys.argv[1:])}`",
        "",
        f"Teacher: the built-in default run, {teacher['rl_steps']} RL steps (seed {args.teacher_seed}); held-out "
        f"accuracy {teacher['accuracy_after_warm_start']:.3f} after its warm start -> **{teacher['accuracy']:.3f}**. "
        f"Student: `megatron-rl sft` for {args.student_warm_start} steps ("
        f"{'per seed, at that seed' if args.per_seed_warm_start else f'seed {args.student_seed}, shared by every seed'}"
        f"), then {args.steps} steps of each arm (teacher mode: {args.mode}). Target: {args.target} x teacher = {summary['target']:.3f}.",
        "",
        "| seed | start | RL: steps to target | distill: steps to target | ratio | RL samples | distill samples "
        "| RL final | distill final |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in summary["per_seed"]:
        def steps(value):
            return f"not within {args.steps}" if value > args.steps else str(value)
        lines.append(f"| {s['seed']} | {s['start']:.3f} | {steps(s['rl_steps'])} | {steps(s['distill_steps'])} | "
                     f"{s['ratio']:.2f} | {s['rl_samples'] or '-'} | {s['distill_samples'] or '-'} | "
                     f"{s['rl_final']:.3f} | {s['distill_final']:.3f} |")
    mean = summary["mean"]
    lines += ["", f"Mean steps to the target: RL {mean['rl_steps']:.1f}, distillation {mean['distill_steps']:.1f}: "
              f"**ratio {summary['ratio_of_means']:.2f}** (distillation faster in {summary['distill_faster_in']} of "
              f"{len(summary['per_seed'])} seeds). An arm that never reached it counts {args.steps + 1}.",
              "", f"![held-out accuracy by step and by samples generated]({png.name})", ""]
    measured = [r["teacher_accuracy_measured"] for r in runs if "teacher_accuracy_measured" in r]
    if measured:
        lines.append(f"The teacher's held-out accuracy measured by the distillation runs at their start: "
                     f"{', '.join(f'{m:.3f}' for m in measured)}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=80, help="RL steps of each arm")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--teacher-steps", type=int, default=150)
    parser.add_argument("--teacher-seed", type=int, default=1234)
    parser.add_argument("--student-warm-start", type=int, default=250, help="the student's supervised steps")
    parser.add_argument("--student-seed", type=int, help="the student's warm-start seed (default: the teacher's)")
    parser.add_argument("--per-seed-warm-start", action="store_true", help="a warm start per seed, at that seed")
    parser.add_argument("--target", type=float, default=0.9, help="the fraction of the teacher's accuracy to reach")
    parser.add_argument("--mode", choices=("trainer", "server"), default="trainer", help="rl.teacher.mode")
    parser.add_argument("--group-size", type=int, default=8, help="rl.group_size of the runs (the default's)")
    parser.add_argument("--teacher", help="a teacher run directory already trained by this script (skips step 1)")
    parser.add_argument("--work", help="where the runs go (default: a temporary directory, removed)")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/distill_cpu.md"))
    args = parser.parse_args()
    args.seed_list = list(range(args.first_seed, args.first_seed + args.seeds))
    if args.student_seed is None:
        args.student_seed = args.teacher_seed
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="distill-bench-") as scratch:
        root = Path(args.work or scratch)
        root.mkdir(parents=True, exist_ok=True)
        if args.teacher:
            evals = [r for r in rows_of(Path(args.teacher)) if "eval/accuracy" in r]
            teacher = {"hf_model": str(Path(args.teacher) / "hf_model"), "accuracy": evals[-1]["eval/accuracy"],
                       "accuracy_after_warm_start": evals[0]["eval/accuracy"], "rl_steps": evals[-1]["step"]}
        else:
            teacher = train_teacher(root, args)
        print(f"teacher: held-out accuracy {teacher['accuracy']:.3f} ({teacher['hf_model']})", flush=True)
        runs = []
        for seed in args.seed_list:
            warm = student_warm_start(root, seed if args.per_seed_warm_start else args.student_seed, args)
            for arm in ("rl", "distill"):
                runs.append(run_arm(root, arm, seed, warm, teacher, args))
                curve = runs[-1]["curve"]
                print(f"seed {seed} {arm}: held-out {curve[0][2]:.3f} -> {curve[-1][2]:.3f} in "
                      f"{runs[-1]['wall_s']:.0f} s", flush=True)
    summary = summarize(runs, teacher, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    plot(runs, teacher, summary, png)
    out.write_text(report(teacher, runs, summary, args, png, time.perf_counter() - started))
    recorded = dict(teacher, hf_model="TEACHER_RUN/hf_model")  # no path of this machine in the record
    out.with_suffix(".json").write_text(json.dumps({"teacher": recorded, "runs": runs, "summary": summary}, indent=1))
    for s in summary["per_seed"]:
        print(f"seed {s['seed']}: steps to {args.target} x teacher: RL {s['rl_steps']}, distillation "
              f"{s['distill_steps']} (ratio {s['ratio']:.2f})")
    print(f"mean steps: RL {summary['mean']['rl_steps']:.1f}, distillation {summary['mean']['distill_steps']:.1f}; "
          f"ratio distillation / RL = {summary['ratio_of_means']:.2f}; report {out}")


if __name__ == "__main__":
    main()
