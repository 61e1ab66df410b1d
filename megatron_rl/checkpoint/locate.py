"""Which checkpoint directory a path names, from the files alone (no torch): the forms
checkpoint/format.py's module docstring lists (a checkpoint, RUN/checkpoints, a run directory).
format.py re-exports these; `megatron-rl eval` tells its --ckpt kinds apart with them in
milliseconds, before anything heavy is imported."""

from __future__ import annotations

from pathlib import Path

from megatron_rl.errors import ConfigError

METADATA = "megatron_rl.json"
LATEST = "latest"  # in a checkpoints directory: the name of the newest step directory
LATEST_BYTES = 4096  # far above a step directory's name; what is read of a `latest` file at most


def is_megatron_checkpoint(path: str | Path) -> bool:
    """A directory in the format of checkpoint/format.py (else, for checkpoint.init_from: a Hugging Face model)."""
    return (Path(path) / METADATA).is_file()


def names_megatron_checkpoint(path: str | Path) -> bool:
    """`path` is meant as a megatron-rl checkpoint in one of the forms `resolve_checkpoint` takes
    (a checkpoint, a checkpoints directory, a run directory), not as a Hugging Face model."""
    path = Path(path)
    return is_megatron_checkpoint(path) or (path / LATEST).is_file() or (path / "checkpoints").is_dir()


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory (holding megatron_rl.json) that `path` names: itself, the step
    that `path/latest` names, or the one `path/checkpoints/latest` names (a run directory)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise ConfigError(f"checkpoint {path} is a file; pass the checkpoint directory (the one holding {METADATA})")
    if is_megatron_checkpoint(path):
        return path
    if (path / "checkpoints").is_dir():
        return _newest_step(path / "checkpoints", run=path)
    if (path / LATEST).is_file() or any(path.glob("step_*")):
        return _newest_step(path)
    raise ConfigError(
        f"{path} is not a megatron-rl checkpoint: it holds no {METADATA}, no {LATEST} file and no checkpoints/ "
        "directory. Pass the output of `megatron-rl convert hf-to-megatron` or `megatron-rl sft`, a training "
        "checkpoint (RUN/checkpoints/step_NNNNNN), RUN/checkpoints or the run directory RUN"
    )


def _newest_step(root: Path, run: Path | None = None) -> Path:
    """The step directory `root/latest` names; `run`: the run directory `root` belongs to."""
    latest = root / LATEST
    if not latest.is_file():
        steps = sorted(p.name for p in root.glob("step_*") if p.is_dir())
        if run is not None and not steps:
            raise ConfigError(f"run directory {run} has no checkpoints yet ({latest} does not exist)")
        hint = f"; pass a step directory instead, e.g. {root / steps[-1]}" if steps else ""
        raise ConfigError(f"{latest} does not exist, so the newest checkpoint is unknown{hint}")
    name = latest_name(latest)
    if not name or Path(name).name != name or name in (".", ".."):
        raise ConfigError(f"{latest} should hold the name of a step directory, not {name!r}; "
                          "pass a step directory (e.g. step_000030) instead")
    step = root / name
    if not step.is_dir():
        raise ConfigError(f"{latest} names {name}, but {step} does not exist (deleted?); pass an existing "
                          "step directory instead")
    if not is_megatron_checkpoint(step):
        raise ConfigError(f"{step} holds no {METADATA}: the save did not finish, or an older megatron-rl "
                          "wrote it; pass another step directory")
    return step


def latest_name(latest: Path) -> str:
    """The step name a `latest` file holds (what the store writes: one short line), read at most
    LATEST_BYTES of it: a damaged or foreign one (not UTF-8, gigabytes) is refused by name, not a
    UnicodeDecodeError or a whole-file read."""
    with latest.open("rb") as handle:
        raw = handle.read(LATEST_BYTES + 1)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{latest} is not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start}); it "
                          "should hold the name of a step directory: pass a step directory (e.g. step_000030) "
                          "instead") from None
    if len(raw) > LATEST_BYTES:
        raise ConfigError(f"{latest} holds more than {LATEST_BYTES} bytes; it should hold the name of a step "
                          "directory: pass a step directory (e.g. step_000030) instead")
    return text.strip()
