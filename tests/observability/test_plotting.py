"""The learning-curve PNG: three panels on a shared step axis (reward / accuracy, response
length with the truncated fraction, entropy with the clip fractions); a panel with nothing
logged still appears, with a "not logged" note."""

from __future__ import annotations

import io

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from megatron_rl.observability.metrics_log import MetricsLog, read_metrics  # noqa: E402
from megatron_rl.observability.plotting import (learning_curve_figure, learning_summary,  # noqa: E402
                                                plot_learning_curve, save_figure)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FULL_LABELS = {
    "reward": ["train reward (mean)", "train accuracy", "held-out accuracy"],
    "length": ["mean length (all)", "mean length (correct)", "mean length (wrong)", "truncated fraction"],
    "entropy": ["entropy (per-token mean)", "clip fraction low", "clip fraction high"],
}


def write_run(run_dir, steps=4, full=True):
    log = MetricsLog(run_dir, steps, wandb_mode="disabled", stream=io.StringIO())
    for step in range(steps + 1):
        row = {"reward/mean": 0.1 * step, "train/accuracy": 0.08 * step}
        if step % 2 == 0:
            row["eval/accuracy"] = 0.2 + 0.05 * step
        if full:
            row.update({
                "response/length_mean": 300.0 + 10 * step,
                "length_bias/length/correct_mean": 250.0 + 5 * step,
                "length_bias/length/wrong_mean": 350.0 + 20 * step,
                "response/truncated_frac": 0.02 * step,
                "actor/entropy": 0.6 - 0.05 * step,
                "actor/clip_frac_low": 0.001 * step,
                "actor/clip_frac_high": 0.003 * step,
            })
        log.step(step, row)
    log.close()
    return run_dir / "metrics.jsonl"


def panels(figure):
    """{panel: (main axis, [line labels of the panel's main and right axes])}."""
    out = {}
    for axis in figure.axes:
        name = axis.get_label().split(":")[0]
        main, labels = out.get(name, (None, []))
        out[name] = (axis if ":" not in axis.get_label() else main, labels + [l.get_label() for l in axis.get_lines()])
    return out


def notes(axis):
    return [t.get_text() for t in axis.texts]


def test_three_panels_with_every_series(tmp_path):
    path = write_run(tmp_path)
    figure = learning_curve_figure(read_metrics(path), title="dapo on gsm8k")
    try:
        got = panels(figure)
        assert list(got) == ["reward", "length", "entropy"]  # stacked top to bottom
        assert {name: labels for name, (_, labels) in got.items()} == FULL_LABELS
        mains = [got[name][0] for name in FULL_LABELS]
        assert [a.get_subplotspec().rowspan.start for a in mains] == [0, 1, 2]
        assert all(mains[0].get_shared_x_axes().joined(mains[0], a) for a in mains[1:])
        assert all(notes(a) == [] for a in mains)
        assert len(figure.axes) == 5  # the length and entropy panels have a right axis
        # the plotted data are the logged values
        (line,) = [l for l in got["entropy"][0].get_lines() if l.get_label() == "entropy (per-token mean)"]
        assert list(line.get_xdata()) == [0, 1, 2, 3, 4]
        assert list(line.get_ydata()) == [0.6 - 0.05 * s for s in range(5)]
        (held_out,) = [l for l in got["reward"][0].get_lines() if l.get_label() == "held-out accuracy"]
        assert list(held_out.get_xdata()) == [0, 2, 4]
        assert mains[0].get_title() == "dapo on gsm8k"
    finally:
        plt.close(figure)
    png = plot_learning_curve(path, tmp_path / "curve.png")
    assert png == tmp_path / "curve.png" and png.read_bytes()[:8] == PNG_MAGIC


def test_panels_without_data_say_not_logged(tmp_path):
    path = write_run(tmp_path, full=False)  # only reward / accuracy keys
    figure = learning_curve_figure(read_metrics(path))
    try:
        got = panels(figure)
        assert list(got) == ["reward", "length", "entropy"]
        assert len(figure.axes) == 3  # no right axes without their keys
        assert got["reward"][1] == FULL_LABELS["reward"] and notes(got["reward"][0]) == []
        for name in ("length", "entropy"):
            axis, labels = got[name]
            assert labels == [] and notes(axis) == ["not logged"], name
    finally:
        plt.close(figure)
    empty = learning_curve_figure([])  # nothing at all: still the same three panels
    try:
        assert [notes(a) for a in empty.axes] == [["not logged"]] * 3
    finally:
        plt.close(empty)


def test_learning_summary_writes_the_png(tmp_path):
    open_before = set(plt.get_fignums())
    write_run(tmp_path, steps=4)
    start, final, png = learning_summary(tmp_path, last_step=4, title="t")
    assert start == 0.2 and final == 0.2 + 0.05 * 4
    assert png == tmp_path / "learning_curve.png" and png.read_bytes()[:8] == PNG_MAGIC
    assert learning_summary(tmp_path, last_step=5)[1] is None  # not evaluated at step 5
    assert learning_summary(tmp_path / "none", last_step=0) == (None, None, None)  # no metrics yet
    assert set(plt.get_fignums()) == open_before  # every figure it drew is closed


def test_each_rl_eval_set_gets_a_pass_at_1_line_on_the_reward_panel(tmp_path):
    """rl.eval's eval/<set>/pass@1 rows (steps 0 and 4 here) are lines of the reward panel, one per
    set in name order; their other figures (pass@4, avg@n) are not drawn."""
    log = MetricsLog(tmp_path, 4, wandb_mode="disabled", stream=io.StringIO())
    for step in range(5):
        row = {"reward/mean": 0.1 * step}
        if step in (0, 4):
            row.update({"eval/humaneval/pass@1": 0.1 + 0.1 * step, "eval/humaneval/pass@4": 0.5,
                        "eval/arith/pass@1": 0.3, "eval/arith/avg@4": 0.3})
        log.step(step, row)
    log.close()
    figure = learning_curve_figure(read_metrics(tmp_path / "metrics.jsonl"))
    try:
        axis, labels = panels(figure)["reward"]
        assert labels == ["train reward (mean)", "arith pass@1", "humaneval pass@1"]
        (line,) = [l for l in axis.get_lines() if l.get_label() == "humaneval pass@1"]
        assert list(line.get_xdata()) == [0, 4] and list(line.get_ydata()) == [0.1, 0.5]
    finally:
        plt.close(figure)


def test_save_figure_closes_the_figure_written_or_not(tmp_path):
    """The one writer of the learning curve and of the evaluation's pass@k figure: a figure it could
    not write (no such directory) is closed too, not left holding its memory."""
    open_before = set(plt.get_fignums())
    with pytest.raises(FileNotFoundError):
        save_figure(plt.figure(), tmp_path / "missing" / "curve.png")
    assert set(plt.get_fignums()) == open_before
    assert save_figure(plt.figure(), tmp_path / "curve.png").read_bytes()[:8] == PNG_MAGIC
    assert set(plt.get_fignums()) == open_before
