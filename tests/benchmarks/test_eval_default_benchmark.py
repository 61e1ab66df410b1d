"""benchmarks/eval_default.py's report from an eval.json, in process: two checkpoints' outcomes
built by hand (known counts) through evaluation/report.py's build_report -> the tables' cells, the
cross-check line against the run's metrics.jsonl rows, and no path of this machine in the
command line it prints. No training run, no engine."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from _support.processes import REPO
from megatron_rl.evaluation.records import PromptOutcome, SampleOutcome, SetOutcome
from megatron_rl.evaluation.report import CheckpointEval, build_report


def _benchmark():
    spec = importlib.util.spec_from_file_location("eval_default_benchmark", REPO / "benchmarks" / "eval_default.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def outcome(name: str, correct: list[int], greedy: list[bool], n: int = 4) -> SetOutcome:
    """Prompt i with correct[i] of n samples correct (the first ones) and its greedy verdict."""
    def sample(ok: bool) -> SampleOutcome:
        return SampleOutcome(reward=float(ok), correct=ok, answer=None, length=3, truncated=False)

    return SetOutcome(name=name, path=f"{name}.jsonl", n=n, temperature=1.0, top_p=1.0, threshold=0.5,
                      prompts=[PromptOutcome(i, [sample(j < c) for j in range(n)], sample(g))
                               for i, (c, g) in enumerate(zip(correct, greedy))])


def test_the_report_tables_and_the_cross_check(tmp_path):
    bench = _benchmark()
    start = CheckpointEval("warm_start", "w", None, None, [outcome("heldout", [0, 2, 4, 1], [False, True, True, False]),
                                                          outcome("add99", [0, 0, 1, 0], [False] * 4)])
    end = CheckpointEval("trained", "r", "runs/default", 150, [outcome("heldout", [4, 4, 4, 2], [True] * 4),
                                                              outcome("add99", [0, 1, 1, 0], [False, True, False, False])])
    report = build_report([start, end], {}, [1, 4], resamples=50)
    metrics = [{"step": 0, "eval/accuracy": 0.5}, {"step": 1}, {"step": 150, "eval/accuracy": 1.0}]
    args = SimpleNamespace(argv=bench.shown_arguments(["--work", "/scratch/x", "--n=4", "--out=/r/eval.md"]), n=4)
    text = bench.render(report, Path("runs/default"), metrics, args, {"sft": 27.0, "eval": 45.0},
                        REPO / "benchmarks" / "results" / "eval_cpu_pass_at_k.png")
    assert "Command: `python benchmarks/eval_default.py --n=4`." in text and "/scratch" not in text
    assert "step 0 0.5000 vs `greedy` of warm_start on heldout 0.5000; step 150 1.0000 vs trained 1.0000" in text
    rows = {line.split(" | ")[0]: line for line in text.split("## add99")[0].splitlines() if line.startswith("| ")}
    # heldout: pass@1 = mean(c) / 4 = 7/16 then 14/16; pass@4 = share of prompts with c > 0: 3/4 then 1
    assert rows["| pass@1"].startswith(f"| pass@1 | {7 / 16:.3f} [") and f"| {14 / 16:.3f} [" in rows["| pass@1"]
    assert f"| {7 / 16:+.3f} [" in rows["| pass@1"]
    assert rows["| pass@4"].startswith("| pass@4 | 0.750 [") and "| 1.000 [" in rows["| pass@4"]
    assert rows["| greedy"].startswith("| greedy | 0.500 [") and "| +0.500 [" in rows["| greedy"]
    assert "## add99 (4 prompts, n = 4)" in text and "`benchmarks/results/eval_cpu_pass_at_k.png`" in text


@pytest.mark.parametrize("argv,shown", [(["--run", "runs/x", "--k", "1,8"], ["--k", "1,8"]),
                                        (["--run=runs/x", "--work=/w"], [])])
def test_paths_are_left_out_of_the_command_line(argv, shown):
    assert _benchmark().shown_arguments(argv) == shown
