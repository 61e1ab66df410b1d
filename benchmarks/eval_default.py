"""What RL did to the tiny default, measured by `megatron-rl eval`: its warm start against its end.

The README's main job (`megatron-rl train --output-dir runs/default`, the built-in tiny default) is
reused where --run holds a finished one, else run. Its start checkpoint, the weights after the
warm start that RL began from, is written by `megatron-rl sft` with the same (default) settings:
the same function as the in-train warm start, so the same weights (train/sft.py), which the
greedy figure cross-checks against the run's own step-0 held-out accuracy. Then one
`megatron-rl eval` of both checkpoints, on the same prompts and sample seeds, n samples per prompt
(--n 16, --k 1,4,16) plus greedy, on two sets:

    heldout   the run's own held-out set (the default's synthetic `add`, operands 0..30), named by
              the set PATH `heldout` (`--set heldout=heldout`): the set the run's eval/accuracy measures
    add99     a harder variant of the task: the same prompts' form, operands 0..99, written here as
              a prompt file (another task config than the run's, so not the run's `heldout`)

The figures with their bootstrap intervals over prompts, the differences trained - warm start with
paired intervals, and the pass@k figure go to --out (benchmarks/results/eval_cpu.md and
eval_cpu_pass_at_k.png beside it).

    .venv/bin/python benchmarks/eval_default.py                    # reuses runs/default if finished
    .venv/bin/python benchmarks/eval_default.py --run runs/other --n 8 --k 1,8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HARDER = {"max_operand": 99}  # the harder variant's TaskConfig changes (the default's is 30)


def cli(*args: str) -> float:
    """`megatron-rl ARGS` in a child process (its output shown); the wall seconds it took."""
    command = [sys.executable, "-m", "megatron_rl.cli", *args]
    print("$ megatron-rl " + " ".join(args), flush=True)
    started = time.perf_counter()
    result = subprocess.run(command, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"megatron-rl {' '.join(args)} failed:\n{(result.stdout + result.stderr)[-4000:]}")
    return time.perf_counter() - started


def check_default_run(run: Path) -> None:
    """The run was the README's main job: its recorded config is the built-in default's (keys
    added to the config since it ran aside), so `megatron-rl sft` with the defaults rebuilds its
    warm start."""
    from megatron_rl.config import load_config, to_dict

    recorded, default = json.loads((run / "run.json").read_text())["config"], to_dict(load_config(None, []))

    def differences(a: dict, b: dict, prefix: str = "") -> list[str]:
        found = []
        for key in a.keys() & b.keys():
            if isinstance(a[key], dict) and isinstance(b[key], dict):
                found += differences(a[key], b[key], f"{prefix}{key}.")
            elif a[key] != b[key] and f"{prefix}{key}" != "output_dir":
                found.append(f"{prefix}{key}: {a[key]!r} (default {b[key]!r})")
        return found

    changed = differences(recorded, default)
    if changed:
        raise SystemExit(f"{run} was not run with the default settings ({'; '.join(changed[:3])}): its warm start "
                         "cannot be rebuilt with `megatron-rl sft`; pass --run with a default run's directory")


def write_harder_set(directory: Path) -> Path:
    """The default's held-out split of the harder task (HARDER), as a prompt file `eval --set` reads."""
    from dataclasses import replace

    from megatron_rl.config import load_config
    from megatron_rl.data import load_heldout

    data = load_config(None, []).data
    heldout = load_heldout(replace(data, synthetic=replace(data.synthetic, **HARDER)))
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "add99.jsonl"
    path.write_text("".join(json.dumps({"prompt": r.prompt, "answer": r.answer, **r.metadata}) + "\n"
                            for r in heldout))
    return path


def shown_arguments(argv: list[str]) -> list[str]:
    """The arguments as run, without the ones naming this machine's paths (--work, --out, --run)."""
    shown, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.split("=", 1)[0] in ("--work", "--out", "--run"):
            skip = "=" not in arg
        else:
            shown.append(arg)
    return shown


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def cell(figure: dict) -> str:
    return f"{figure['value']:.3f} [{figure['low']:.3f}, {figure['high']:.3f}]"


def difference_cell(figure: dict) -> str:
    return f"{figure['difference']:+.3f} [{figure['low']:+.3f}, {figure['high']:+.3f}]"


def render(report: dict, run: Path, metrics: list[dict], args, walls: dict, png: Path) -> str:
    start, end = report["checkpoints"]
    (difference,) = report["differences"]
    accuracy = {r["step"]: r["eval/accuracy"] for r in metrics if "eval/accuracy" in r}
    last = max(accuracy)
    lines = [
        "# `megatron-rl eval` on the tiny default: warm start against trained",
        "",
        f"Command: `{' '.join(['python benchmarks/eval_default.py', *args.argv])}`. Machine: {cpu_name()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}; `megatron-rl sft` (the warm start) "
        f"{walls['sft']:.0f} s, "
        f"`megatron-rl eval` (2 checkpoints x 2 sets) {walls['eval']:.0f} s"
        + (f", the main job {walls['train']:.0f} s" if "train" in walls else " (the main job's run reused)") + ".",
        "",
        f"Checkpoints: **{start['label']}** = the weights RL started from (`megatron-rl sft` with the default's "
        f"settings), **{end['label']}** = the main job's last checkpoint ({run.parent.name}/{run.name}, step "
        f"{end['step']}). Each set: "
        f"{args.n} samples per prompt at temperature 1.0 plus one greedy response, the same prompts and sample "
        "seeds for both; intervals: 95% bootstrap over prompts (differences: paired).",
        "",
        "Cross-check against the run's own held-out accuracy (metrics.jsonl `eval/accuracy`, greedy, the "
        "same prompts): "
        f"step 0 {accuracy[0]:.4f} vs `greedy` of {start['label']} on heldout "
        f"{start['sets'][0]['figures']['figures']['greedy']['value']:.4f}; step {last} {accuracy[last]:.4f} vs "
        f"{end['label']} {end['sets'][0]['figures']['figures']['greedy']['value']:.4f}.",
        "",
    ]
    for index, compared in enumerate(difference["sets"]):
        name, n = compared["set"], compared["n"]
        lines += [f"## {name} ({compared['prompts']} prompts, n = {n})", "",
                  f"| figure | {start['label']} | {end['label']} | {end['label']} - {start['label']} |",
                  "|---|---|---|---|"]
        figures_a = start["sets"][index]["figures"]["figures"]
        figures_b = end["sets"][index]["figures"]["figures"]
        names = ["greedy", f"avg@{n}"] + [f"pass@{k}" for k in compared["ks"]] + [f"maj@{k}" for k in compared["ks"]]
        for figure in names:
            if figure in compared["figures"]:
                lines.append(f"| {figure} | {cell(figures_a[figure])} | {cell(figures_b[figure])} | "
                             f"{difference_cell(compared['figures'][figure])} |")
        lines.append("")
    lines += [f"pass@k against k, both checkpoints, each set: `{png.relative_to(REPO)}`.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default=str(REPO / "runs" / "default"), help="the main job's run directory")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--k", default="1,4,16")
    parser.add_argument("--work", help="scratch directory (default: a temporary one, removed at the end)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "eval_cpu.md"))
    args = parser.parse_args(argv)
    args.argv = shown_arguments(argv if argv is not None else sys.argv[1:])
    run, out = Path(args.run), Path(args.out).resolve()  # the report names the figure relative to the repository
    walls = {}
    state = run / "run_state.json"
    if not (state.is_file() and json.loads(state.read_text()).get("finished")):
        walls["train"] = cli("train", "--output-dir", str(run))
    check_default_run(run)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="eval-default-"))
    try:
        harder = write_harder_set(work / "sets")
        warm = work / "warm_start"
        walls["sft"] = cli("sft", "--output-dir", str(warm), "--force")
        report_dir = work / "eval"
        walls["eval"] = cli("eval", "--ckpt", str(warm), "--ckpt", str(run), "--label", "warm_start",
                            "--label", "trained", "--set=heldout=heldout", f"--set=add99={harder}",
                            "--n", str(args.n), "--k", args.k, "--out", str(report_dir), "--overwrite")
        report = json.loads((report_dir / "eval.json").read_text())
        png = out.with_name(out.stem + "_pass_at_k.png")
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(report_dir / "pass_at_k.png", png)
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        out.write_text(render(report, run, metrics, args, walls, png))
        print(out.read_text())
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
