"""The learning curve every run writes as a PNG (matplotlib, no display needed).

Three panels stacked on one shared step axis (``learning_curve_figure``):

1. ``reward``: train reward, train accuracy, held-out accuracy, and pass@1 of each rl.eval set
   (``eval/<set>/pass@1``) where the run logged one.
2. ``length``: mean response length of all samples (``response/length_mean``), of correct and of
   wrong ones (``length_bias/length/correct_mean`` / ``wrong_mean``: wrong answers growing longer
   is GRPO's length bias), and on a right axis the truncated fraction (``response/truncated_frac``).
3. ``entropy``: the policy's per-token mean entropy (``actor/entropy``, nats), and on a right axis
   the fractions of tokens clipped at the lower / upper bound (``actor/clip_frac_low`` /
   ``_high``).

A panel none of whose keys was logged is drawn anyway, with the note "not logged", so every run's
figure has the same layout. The main panels' axes carry the labels ``reward``, ``length`` and
``entropy`` (``Axes.get_label()``); a right axis is ``<panel>:right``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from megatron_rl.observability.metrics_log import read_metrics

# (panel label, y label, left-axis series, right-axis label, right-axis series);
# a series is (metric key, line label, style).
PANELS = (
    ("reward", "reward / accuracy",
     (("reward/mean", "train reward (mean)", "-"),
      ("train/accuracy", "train accuracy", ":"),
      ("eval/accuracy", "held-out accuracy", "o-")),
     None, ()),
    ("length", "response length (tokens)",
     (("response/length_mean", "mean length (all)", "-"),
      ("length_bias/length/correct_mean", "mean length (correct)", "--"),
      ("length_bias/length/wrong_mean", "mean length (wrong)", ":")),
     "truncated fraction",
     (("response/truncated_frac", "truncated fraction", "-."),)),
    ("entropy", "entropy (nats / token)",
     (("actor/entropy", "entropy (per-token mean)", "-"),),
     "clipped token fraction",
     (("actor/clip_frac_low", "clip fraction low", "--"),
      ("actor/clip_frac_high", "clip fraction high", ":"))),
)
X_LABEL = "RL step (0 = after the warm start)"


def pyplot():
    """matplotlib.pyplot on the Agg backend: the project's figures go to files, never a window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, png_path: str | Path) -> Path:
    """Writes `figure` to `png_path` and closes it, written or not (an open figure keeps its memory
    until the process ends)."""
    png_path = Path(png_path)
    try:
        figure.savefig(png_path)
    finally:
        pyplot().close(figure)
    return png_path


def _series(records: Sequence[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """(step, value) of the records that logged ``key`` as a number."""
    points = []
    for r in records:
        value = r.get(key)
        if "step" in r and isinstance(value, (int, float)) and not isinstance(value, bool):
            points.append((r["step"], value))
    return points


def _eval_set_lines(records: Sequence[dict[str, Any]]) -> tuple:
    """A (key, label, style) line per rl.eval set that logged pass@1, in name order."""
    keys = sorted({key for r in records for key in r if key.startswith("eval/") and key.endswith("/pass@1")})
    return tuple((key, f"{key[len('eval/'):-len('/pass@1')]} pass@1", "s--") for key in keys)


def learning_curve_figure(records: Sequence[dict[str, Any]], title: str = ""):
    """The learning-curve figure of a run's metric records (``read_metrics``); the caller saves
    and closes it. Three panels sharing the x axis (module docstring)."""
    figure, axes = pyplot().subplots(3, 1, sharex=True, figsize=(7, 9), dpi=110)
    for axis, (name, y_label, left, right_label, right) in zip(axes, PANELS):
        axis.set_label(name)
        handles = []
        for key, label, style in left + (_eval_set_lines(records) if name == "reward" else ()):
            points = _series(records, key)
            if points:
                steps, values = zip(*points)
                handles += axis.plot(steps, values, style, label=label, markersize=4)
        right_points = [(spec, _series(records, spec[0])) for spec in right]
        if any(points for _, points in right_points):
            twin = axis.twinx()
            twin.set_label(f"{name}:right")
            for (key, label, style), points in right_points:
                if points:
                    steps, values = zip(*points)
                    # the twin's colour cycle restarts: continue the left axis's colours instead
                    handles += twin.plot(steps, values, style, label=label, markersize=4,
                                         color=f"C{len(handles) % 10}")
            twin.set_ylabel(right_label)
            twin.set_ylim(bottom=0.0)
        axis.set_ylabel(y_label)
        axis.grid(alpha=0.3)
        if name == "reward":
            axis.set_ylim(-0.02, 1.02)
        if handles:
            axis.legend(handles=handles, loc="lower right" if name == "reward" else "best", fontsize="small")
        else:
            axis.text(0.5, 0.5, "not logged", transform=axis.transAxes, ha="center", va="center", color="gray")
    axes[-1].set_xlabel(X_LABEL)
    if title:
        axes[0].set_title(title)
    # Fixed margins, not tight_layout(): its measuring pass drew every tick and label once more
    # (0.15 of the 0.45 CPU-s each run's figure took); these fit 5-digit ticks and the right axes' labels.
    figure.subplots_adjust(left=0.125, right=0.88, bottom=0.06, top=0.955 if title else 0.975, hspace=0.08)
    return figure


def plot_learning_curve(metrics_path: str | Path, png_path: str | Path, title: str = "") -> Path:
    """Draws the metrics.jsonl at ``metrics_path`` (``learning_curve_figure``) to ``png_path``."""
    return save_figure(learning_curve_figure(read_metrics(metrics_path), title=title), png_path)


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
