"""What a command that writes an output directory (`megatron-rl sft`, `megatron-rl convert ...`)
may put there, and what its --force may replace.

Two rules, checked before anything is read or written:

* An output that is an input, contains one or lies inside one (after resolving symbolic links) is
  refused by name, with or without --force: replacing it would delete what the command reads
  (`convert megatron-to-hf --ckpt /x/run --out /x --force` once removed the run), and writing
  into it would mix the output into the input.
* --force replaces only what the same command wrote before. Each output carries a marker file
  (MARKER, JSON naming the command), written into the staging directory with the output itself;
  an existing directory without it (a training run, a Hugging Face download, anything else) or
  with another command's marker is left alone.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_rl.errors import ConfigError

MARKER = ".megatron-rl-output.json"


def refuse_overlap(out: str | Path, inputs: dict[str, str | Path | None], *, inside_ok: tuple[str, ...] = ()) -> None:
    """ConfigError when `out` is, contains or lies inside one of `inputs` ({what the user named it:
    path}; None and paths that do not exist are skipped). `inside_ok`: inputs `out` may lie inside
    (a run directory that only stands for the checkpoint under it)."""
    target = Path(out).resolve()
    for name, given in inputs.items():
        if given is None or not Path(given).exists():
            continue
        source = Path(given).resolve()
        if target == source:
            relation = "is"
        elif target in source.parents:
            relation = "contains"
        elif source in target.parents and name not in inside_ok:
            relation = "lies inside"
        else:
            continue
        shown = f"{given}" if Path(given) == source else f"{given} (= {source})"
        raise ConfigError(f"output {out} {relation} the input {name} {shown}; writing it would overwrite or "
                          "mix into what this command reads, so it is refused (--force does not change that): "
                          "pass an output outside every input")


def written_by(out: str | Path) -> str | None:
    """The command named by `out`'s marker, or None (no marker, not a directory, unreadable)."""
    try:
        return json.loads((Path(out) / MARKER).read_text())["command"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def refuse_existing(out: str | Path, force: bool, owner: str | None = None) -> None:
    """ConfigError when `out` exists and may not be replaced: always without `force`; with it,
    unless `out` is a directory carrying `owner`'s marker. `owner=None`: the caller owns the
    place (the trainer's own export in its run directory) and `force` replaces whatever is there."""
    out = Path(out)
    if not (out.exists() or out.is_symlink()):
        return
    kind = "directory" if out.is_dir() else "path (a file, not a directory)"
    mine = owner is None or written_by(out) == owner
    if not force and mine:
        raise ConfigError(f"output {kind} {out} already exists; pass --force to replace it")
    if not mine:
        found = written_by(out)
        what = f"it was written by `{found}`" if found else f"it holds no {MARKER}, so it was not written by `{owner}`"
        raise ConfigError(f"output {kind} {out} already exists and {what}: it is left alone, also with --force "
                          f"(--force replaces only an earlier output of `{owner}`); pass another output, or move "
                          "it away yourself")


def mark(directory: str | Path, owner: str) -> None:
    """Write `owner`'s marker into a staging directory (before its manifest, which then lists it)."""
    (Path(directory) / MARKER).write_text(json.dumps({"command": owner}) + "\n")
