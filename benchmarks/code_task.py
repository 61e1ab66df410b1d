"""The built-in code task learning: held-out pass rate after the warm start vs after RL, one run.

`configs/tiny_code.yaml` through `megatron-rl train` (the real trainer, vLLM's CPU engine, the
`code_tests` reward in the sandbox): a supervised warm start on canonical expressions, the
held-out pass rate (greedy, every hidden test passed) before the first RL step, RL steps, the
held-out pass rate again at each evaluation. The reference is the same run's own warm start:
the delta is what RL added. Also per RL step (medians): seconds scoring (the sandbox), generating
and training, and the sampled reward over the first and the last five steps.

    python benchmarks/code_task.py --quick                    # smoke shape, ~2 min on 2 CPU cores
    python benchmarks/code_task.py --json benchmarks/results/code_task_cpu.json   # the recipe

With --score-chunks K: scoring beside generation instead (rollout.score_chunks, train/collect.py):
the recipe's first RL steps twice from the same warm start and seeds, each round generated as one
request then scored (the reference), and as K requests with each scored while the next generates;
printed: the medians of generate + score seconds per step and their ratio K/1.

    python benchmarks/code_task.py --score-chunks 4 rl.steps=6 rl.eval_every=0
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
RECIPE = REPO / "configs/tiny_code.yaml"
# a few steps of few samples: the pipeline end to end, not the learning
QUICK = ["warm_start.steps=40", "rl.steps=2", "rl.prompts_per_step=4", "rl.group_size=4", "rl.eval_every=2",
         "data.num_heldout=16"]


def train(out: Path, overrides: list[str]) -> tuple[list[dict], float, list[str]]:
    command = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(RECIPE), "--output-dir", str(out),
               "logging.wandb_mode=disabled", "checkpoint.export_hf=false", "checkpoint.every_steps=0", *overrides]
    started = time.perf_counter()
    result = subprocess.run(command, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{(result.stdout + result.stderr)[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rows, wall, command


def summarize(rows: list[dict]) -> dict:
    evals = [r for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if r["step"] >= 1]
    if not evals or evals[0]["step"] != 0:
        raise SystemExit("the run logged no held-out evaluation at step 0 (after the warm start)")

    def median(key: str) -> float | None:
        values = [r[key] for r in steps if key in r]
        return statistics.median(values) if values else None

    def mean(rows: list[dict], key: str) -> float | None:
        values = [r[key] for r in rows if key in r]
        return statistics.fmean(values) if values else None

    warm, final = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    return {"heldout_prompts": evals[0]["eval/prompts"], "rl_steps": len(steps),
            "pass_rate_warm_start": warm, "pass_rate_after_rl": final, "delta": final - warm,
            "pass_rate_best": max(r["eval/accuracy"] for r in evals),
            "eval_curve": [(r["step"], r["eval/accuracy"]) for r in evals],
            "train_reward_first5": mean(steps[:5], "reward/mean"),
            "train_reward_last5": mean(steps[-5:], "reward/mean"),
            "reward_errors": sum(r.get("reward/errors", 0) for r in steps),
            "reward_timeouts": sum(r.get("reward/code_tests/timeouts", 0) for r in steps),
            "score_s_per_step": median("time/score_s"), "generate_s_per_step": median("time/generate_s"),
            "train_s_per_step": median("time/train_s"), "step_s": median("time/step_s")}


def machine() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
        model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "unknown")
    except OSError:
        model = "unknown (no lscpu)"
    return f"{model}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def compare_score_chunks(work: Path, overrides: list[str], chunks: int, json_path: str | None) -> None:
    """Generate + score seconds per step, one request then scoring vs `chunks` requests each scored
    while the next generates; the same steps, seeds and warm start (a pure function of the seed)."""
    results = {"machine": machine(), "overrides": overrides, "score_chunks": chunks}
    for name, k in (("reference", 1), ("chunked", chunks)):
        rows, wall, _ = train(work / name, [*overrides, f"rollout.score_chunks={k}"])
        steps = [r for r in rows if r["step"] >= 1]
        rollout = [r["time/generate_s"] + r["time/score_s"] for r in steps]
        results[name] = {"score_chunks": k, "wall_s": wall, "rollout_s_per_step": statistics.median(rollout),
                         "generate_s_per_step": statistics.median(r["time/generate_s"] for r in steps),
                         "score_s_per_step": statistics.median(r["time/score_s"] for r in steps),
                         "rewards": [r["reward/mean"] for r in steps]}
    reference, chunked = results["reference"], results["chunked"]
    results["ratio"] = chunked["rollout_s_per_step"] / reference["rollout_s_per_step"]
    print(f"generate + score per RL step (median of {len(reference['rewards'])}): one request then scoring "
          f"{reference['rollout_s_per_step']:.2f} s (generate {reference['generate_s_per_step']:.2f}, score "
          f"{reference['score_s_per_step']:.2f}); {chunks} requests scored beside generation "
          f"{chunked['rollout_s_per_step']:.2f} s (generate {chunked['generate_s_per_step']:.2f}, scoring left "
          f"{chunked['score_s_per_step']:.2f}); ratio {results['ratio']:.2f}; same rewards per step: "
          f"{reference['rewards'] == chunked['rewards']}; on {results['machine']}")
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke shape (a few steps): the pipeline, not learning")
    parser.add_argument("--json", help="write the results here as JSON")
    parser.add_argument("--score-chunks", type=int, default=0,
                        help="compare rollout.score_chunks=K against 1 (scoring beside generation) instead")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the recipe")
    args = parser.parse_args()

    overrides = (QUICK if args.quick else []) + args.overrides
    work = Path(tempfile.mkdtemp(prefix="code-task-"))
    if args.score_chunks:
        compare_score_chunks(work, overrides, args.score_chunks, args.json)
        return
    rows, wall, command = train(work / "run", overrides)
    results = {"machine": machine(), "command": " ".join(command[1:]), "overrides": overrides, "wall_s": wall,
               **summarize(rows)}
    r = results
    curve = " -> ".join(f"{accuracy:.3f}" for _, accuracy in r["eval_curve"])
    print(f"held-out pass rate ({r['heldout_prompts']} problems, greedy, every hidden test passed): "
          f"{r['pass_rate_warm_start']:.3f} after the warm start -> {r['pass_rate_after_rl']:.3f} after "
          f"{r['rl_steps']} RL steps ({r['delta']:+.3f}; evaluations {curve}); sampled reward, first 5 -> last 5 "
          f"steps: {r['train_reward_first5']:.3f} -> {r['train_reward_last5']:.3f}; reward errors "
          f"{r['reward_errors']:.0f}, sandbox timeouts {r['reward_timeouts']:.0f}; median per step: score "
          f"{r['score_s_per_step']:.2f} s, generate {r['generate_s_per_step']:.2f} s, train "
          f"{r['train_s_per_step']:.2f} s, step {r['step_s']:.2f} s; wall {wall:.0f} s on {r['machine']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
