"""The reward / accuracy curve every run writes as a PNG (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

from megatron_rl.logging import read_metrics


def plot_learning_curve(metrics_path: str | Path, png_path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    figure, axis = plt.subplots(figsize=(7, 4), dpi=110)
    for key, label, style in (("reward/mean", "train reward (mean)", "-"),
                              ("train/accuracy", "train accuracy", ":"),
                              ("eval/accuracy", "held-out accuracy", "o-")):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            steps, values = zip(*points)
            axis.plot(steps, values, style, label=label, markersize=4)
    axis.set_xlabel("RL step (0 = after the warm start)")
    axis.set_ylabel("reward / accuracy")
    axis.set_ylim(-0.02, 1.02)
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right")
    if title:
        axis.set_title(title)
    figure.tight_layout()
    png_path = Path(png_path)
    figure.savefig(png_path)
    plt.close(figure)
    return png_path
