"""The evaluation report (evaluation/report.py): eval.json holds every figure, the config, the
checkpoints, the versions and the outcomes, and every figure re-derives from it; eval.md has one
row per set and checkpoint, the paired differences and the kept responses; the pass@k figure draws
one panel per set and one line per checkpoint on a log-x axis."""

from __future__ import annotations

import importlib.metadata
import json
import random

import pytest

from megatron_rl.errors import ConfigError
from megatron_rl.evaluation.metrics import compare, set_figures
from megatron_rl.evaluation.records import PromptOutcome, SampleOutcome, SetOutcome
from megatron_rl.evaluation.report import (CheckpointEval, build_report, format_differences, pass_at_k_figure,
                                           rederive, render_markdown, write_report)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RESPONSE = "Six sevens: ```42```, so the answer is \\boxed{42}."  # a backtick run inside the text


def outcome(name, n, p_correct, seed, prompts=12):
    rng = random.Random(seed)
    rows = []
    for index in range(prompts):
        samples = []
        for i in range(n):
            correct = rng.random() < p_correct
            samples.append(SampleOutcome(reward=float(correct), correct=correct, answer="42" if correct else "41",
                                         length=rng.randint(20, 200), truncated=rng.random() < 0.1,
                                         text=RESPONSE if index == 0 and i < 2 else ""))
        greedy = SampleOutcome(reward=1.0, correct=True, answer="42", length=30, truncated=False)
        rows.append(PromptOutcome(index=index, samples=samples, greedy=greedy,
                                  prompt="What is 6 x 7?" if index == 0 else ""))
    return SetOutcome(name=name, path=f"sets/{name}.jsonl", n=n, temperature=0.8, top_p=0.95, threshold=0.5,
                      prompts=rows)


def checkpoints():
    return [CheckpointEval("A", "runs/r1/checkpoints/step_0", "runs/r1", 0,
                           [outcome("math", 8, 0.3, 1), outcome("gsm8k", 4, 0.5, 2)]),
            CheckpointEval("B", "runs/r1/checkpoints/step_200", "runs/r1", 200,
                           [outcome("math", 8, 0.6, 3), outcome("gsm8k", 4, 0.5, 4)])]


CONFIG = {"seed": 1, "sets": {"math": "sets/math.jsonl", "gsm8k": "sets/gsm8k.jsonl"}, "max_tokens": (256,)}


def test_the_report_files_hold_every_figure_and_re_derive_from_eval_json(tmp_path):
    import matplotlib.pyplot as plt

    evaluated, open_before = checkpoints(), set(plt.get_fignums())
    paths = write_report(tmp_path / "out", evaluated, CONFIG, [1, 2, 4], resamples=100, seed=3)
    assert paths == {"json": tmp_path / "out" / "eval.json", "md": tmp_path / "out" / "eval.md",
                     "png": tmp_path / "out" / "pass_at_k.png"}
    report = json.loads(paths["json"].read_text())
    assert report["config"] == {**CONFIG, "max_tokens": [256]}
    assert [(c["label"], c["run_dir"], c["step"]) for c in report["checkpoints"]] == [("A", "runs/r1", 0),
                                                                                      ("B", "runs/r1", 200)]
    assert report["versions"]["torch"] == importlib.metadata.version("torch")
    assert report["versions"]["megatron-core"] == importlib.metadata.version("megatron-core")
    assert set(report["versions"]) == {"torch", "vllm", "megatron-core", "megatron-rl"}
    assert report["bootstrap"] == {"resamples": 100, "seed": 3, "confidence": 0.95}
    # The figures are those of the outcomes as eval.json stores them, and re-derive exactly.
    stored = report["checkpoints"][1]["sets"][0]
    assert stored["figures"] == set_figures(SetOutcome.from_json(stored["outcome"]), [1, 2, 4], resamples=100, seed=3)
    assert stored["figures"] == set_figures(evaluated[1].sets[0], [1, 2, 4], resamples=100, seed=3)
    assert report["differences"][0]["sets"][1] == compare(evaluated[0].sets[1], evaluated[1].sets[1], [1, 2, 4],
                                                          resamples=100, seed=3)
    assert rederive(report) == report
    # A figure edited by hand no longer matches its outcomes.
    report["checkpoints"][0]["sets"][1]["figures"]["figures"]["pass@2"]["value"] += 0.01
    assert rederive(report) != report
    assert paths["png"].read_bytes()[:8] == PNG_MAGIC and set(plt.get_fignums()) == open_before
    assert paths["md"].read_text() == render_markdown(json.loads(paths["json"].read_text()))


def test_the_markdown_has_a_row_per_set_and_checkpoint_the_differences_and_the_responses():
    report = build_report(checkpoints(), CONFIG, [1, 4], resamples=100)
    text = render_markdown(report, examples=3)
    rows = [line for line in text.splitlines() if line.startswith(("| math |", "| gsm8k |"))]
    assert [row.split(" | ")[:2] for row in rows] == [["| math", "A"], ["| math", "B"], ["| gsm8k", "A"],
                                                      ["| gsm8k", "B"]]
    pass_1 = report["checkpoints"][1]["sets"][0]["figures"]["figures"]["pass@1"]
    assert f"{pass_1['value']:.3f} [{pass_1['low']:.3f}, {pass_1['high']:.3f}]" in rows[1]
    differences = format_differences(report)
    assert "### math: B - A (12 prompts, paired)" in differences and differences in text
    math_pass_1 = report["differences"][0]["sets"][0]["figures"]["pass@1"]
    assert (f"| pass@1 | {math_pass_1['a']:.3f} | {math_pass_1['b']:.3f} | {math_pass_1['difference']:+.3f} | "
            f"[{math_pass_1['low']:+.3f}, {math_pass_1['high']:+.3f}] |") in differences
    # Two kept responses per set and checkpoint, each in a fence the text's ``` cannot close.
    assert text.count("#### math, A: prompt 0") == 1 and text.count("#### gsm8k, B: prompt 0") == 1
    assert text.count("````\n" + RESPONSE + "\n````") == 8
    assert text.count("sample 1: reward ") == 4
    assert "## Responses" not in render_markdown(report, examples=0)
    alone = build_report(checkpoints()[:1], CONFIG, [1, 4], resamples=100)
    assert format_differences(alone) == "" and "## Differences" not in render_markdown(alone)


def test_the_pass_at_k_figure_draws_each_set_with_a_line_per_checkpoint_on_a_log_axis():
    report = build_report(checkpoints(), CONFIG, None, resamples=100)
    figure = pass_at_k_figure(report)
    try:
        axes = {axis.get_label(): axis for axis in figure.axes if axis.get_visible()}
        assert set(axes) == {"math", "gsm8k"}
        for index, name in enumerate(["math", "gsm8k"]):
            axis = axes[name]
            assert axis.get_xscale() == "log"
            lines = {line.get_label(): line for line in axis.get_lines()}
            assert set(lines) == {"A", "B"}
            for c in report["checkpoints"]:
                figures = c["sets"][index]["figures"]
                assert list(lines[c["label"]].get_xdata()) == figures["ks"]
                assert list(lines[c["label"]].get_ydata()) == [figures["figures"][f"pass@{k}"]["value"]
                                                               for k in figures["ks"]]
            assert len(axis.collections) == 2  # one interval band per checkpoint
    finally:
        import matplotlib.pyplot as plt

        plt.close(figure)


def test_a_report_refuses_checkpoints_evaluated_on_different_sets_and_a_file_as_its_directory(tmp_path):
    a, b = checkpoints()
    b.sets.reverse()
    with pytest.raises(ValueError, match=r"checkpoint 'B' was evaluated on sets \['gsm8k', 'math'\]"):
        build_report([a, b], CONFIG)
    with pytest.raises(ValueError, match="checkpoint labels must differ"):
        build_report([a, CheckpointEval("A", "x", sets=a.sets)], CONFIG)
    occupied = tmp_path / "eval"
    occupied.write_text("")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        write_report(occupied, [a], CONFIG)


def test_each_set_is_reported_with_its_own_ks_and_re_derives_from_eval_json(tmp_path):
    """`megatron-rl eval` hands the report each set's own ks (set.NAME.k, else --k; None: the
    defaults for the set's n): eval.json stores them per set, eval.md heads each set's table with
    them, the differences use them, and a set left out gets the defaults."""
    asked = {"math": [8, 1], "gsm8k": [2]}
    paths = write_report(tmp_path, checkpoints(), CONFIG, asked, resamples=50)
    report = json.loads(paths["json"].read_text())
    assert report["ks"] == {"math": [1, 8], "gsm8k": [2]}
    for c in report["checkpoints"]:
        math, gsm8k = (s["figures"] for s in c["sets"])
        assert (math["ks"], gsm8k["ks"]) == ([1, 8], [2])
        assert [f for f in math["figures"] if f.startswith(("pass@", "maj@"))] == ["pass@1", "pass@8", "maj@1",
                                                                                   "maj@8"]
    assert [s["ks"] for s in report["differences"][0]["sets"]] == [[1, 8], [2]]
    assert rederive(report) == report
    text = paths["md"].read_text()
    assert "### math (12 prompts, n=8, k=1,8)" in text and "### gsm8k (12 prompts, n=4, k=2)" in text
    defaults = build_report(checkpoints(), CONFIG, {"gsm8k": [2]}, resamples=10)
    assert defaults["ks"] == {"math": None, "gsm8k": [2]}
    assert defaults["checkpoints"][0]["sets"][0]["figures"]["ks"] == [1, 2, 4, 8]
    with pytest.raises(ValueError, match=r"ks are given for \['hard'\], which are not among the evaluated sets"):
        build_report(checkpoints(), CONFIG, {"hard": [1]})
