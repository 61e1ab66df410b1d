"""The reward / accuracy curve every run writes as a PNG (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

from megatron_rl.observability.metrics_log import read_metrics


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


def learning_summary(run_dir: str | Path, last_step: int, title: str = "") -> tuple[float | None, float | None, Path | None]:
    """A run's held-out accuracy at step 0 (after the warm start) and at `last_step` (None where
    not evaluated), and its learning curve, drawn to RUN/learning_curve.png (None: no metrics yet)."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    accuracy = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    png = plot_learning_curve(run_dir / "metrics.jsonl", run_dir / "learning_curve.png", title=title) if records else None
    start = next((a for s, a in accuracy if s == 0), None)
    final = accuracy[-1][1] if accuracy and accuracy[-1][0] == last_step else None
    return start, final, png
