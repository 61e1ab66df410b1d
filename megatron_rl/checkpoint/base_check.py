"""How a LoRA run's checkpoint names the frozen base it does not hold, and the comparison of that
base with what the run read (checkpoint/base_ref.py describes and writes bases).

With checkpoint.base_weights=referenced (the default under model.lora) a checkpoint holds the
adapters, their optimizer state, the state buffers (the routers' expert bias), the KL reference's
adapters and the run state; its megatron_rl.json names the base:

    "base": {"path": "../base" or an absolute path, "kind": "megatron" | "hf",
             "files": {relative path: {"bytes": N, "crc32": "..."}}}

A relative path is the checkpoint's (the run's own base, OUTPUT_DIR/checkpoints/base/). When a
checkpoint's base is loaded (resume, init_from) every recorded file is compared with it: sizes
and the small files' CRC-32 first, the weight files' CRC-32 on the bytes the load reads
(bridge/checked_read.py: a file rewritten between a check and the load cannot be loaded);
a conversion compares every CRC-32 first. A difference is refused naming the file: the adapters
were trained on that base and mean something else on another. megatron_rl.json is untrusted
input: an entry of the wrong shape, or naming a file outside the base, is refused before any
file is read. A run checks that its base is still there before each checkpoint it writes
(checkpoint/manager.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_rl.errors import ConfigError


def refers_to_base(metadata) -> bool:
    """Whether a checkpoint (its megatron_rl.json) holds everything but a base it refers to."""
    return isinstance(metadata, dict) and "base" in metadata


def locate(reference: dict, checkpoint: Path) -> Path:
    """The base directory a checkpoint's reference names (a relative path is the checkpoint's)."""
    path = Path(reference["path"])
    return path if path.is_absolute() else Path(os.path.normpath(Path(checkpoint) / path))


def portable(reference: dict, checkpoint: Path, root: Path) -> dict:
    """`reference`, read from `checkpoint`, as the checkpoints written under `root` must name it:
    unchanged when `checkpoint` lies in `root` (the run's own base), else absolute."""
    if Path(checkpoint).resolve().parent == Path(root).resolve() or Path(reference["path"]).is_absolute():
        return reference
    return dict(reference, path=str(locate(reference, checkpoint).resolve()))


def base_problem(reference: dict, checkpoint: Path, checksums: bool = True,
                 checked_on_load: tuple[str, ...] = ()) -> str | None:
    """None if the base `checkpoint` refers to is there as the run read it, else what differs
    (naming the file). `checksums=False`: sizes only (fast: a preflight). `checked_on_load`: the
    endings of the files whose CRC-32 the load itself compares, on the bytes it reads
    (load_referenced_base): their sizes only here."""
    from megatron_rl.bridge.checked_read import outside
    from megatron_rl.checkpoint.store import file_crc32

    malformed = malformed_reference(reference)
    if malformed:
        return f"its megatron_rl.json names the base wrongly ({malformed}); the file was edited or damaged"
    base = locate(reference, checkpoint)
    if not base.is_dir():
        return f"the base model {base} it refers to does not exist (moved or deleted?)"
    changed = f"the base model {base} it refers to has changed"
    for relative, entry in sorted(reference["files"].items()):
        file = base / relative
        escape = outside(base, relative)
        if escape:
            return f"{changed}: {relative} {escape}"
        if not file.is_file():
            return f"{changed}: {relative} is missing"
        if file.stat().st_size != entry["bytes"]:
            return f"{changed}: {relative} has {file.stat().st_size} bytes, {entry['bytes']} when the run read it"
        found = file_crc32(file) if checksums and not relative.endswith(checked_on_load) else entry["crc32"]
        if found != entry["crc32"]:
            return f"{changed}: {relative} has CRC-32 {found}, {entry['crc32']} when the run read it"
    return None


def base_record(reference: dict, checkpoint: Path):
    """The base's files as the run recorded them, for a load that compares them on the bytes it
    reads (bridge/checked_read.py); a difference is refused as base_problem's are."""
    from megatron_rl.bridge.checked_read import Recorded

    base = locate(reference, checkpoint)
    return Recorded(base, reference["files"],
                    lambda problem: refused(checkpoint, f"the base model {base} it refers to has changed: {problem}"))


def malformed_reference(reference) -> str | None:
    """What is wrong with the shape of a "base" entry (a checkpoint is untrusted input), or None."""
    if not isinstance(reference, dict) or not isinstance(reference.get("path"), str) or not reference["path"]:
        return '"base" must be an object with a "path"'
    files = reference.get("files")
    if not isinstance(files, dict) or not files:
        return '"base" must list its "files"'
    for relative, entry in files.items():
        if Path(relative).is_absolute() or ".." in Path(relative).parts:
            return f"file {relative!r} lies outside the base"
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("crc32"), str)):
            return f'file {relative!r} needs "bytes" and "crc32"'
    return None


def refused(checkpoint: Path, problem: str) -> ConfigError:
    return ConfigError(
        f"checkpoint {checkpoint} holds LoRA adapters and refers to its base model instead of holding it "
        f"(checkpoint.base_weights=referenced); {problem}. The adapters were trained on that base and do not "
        "apply to another: put the base back as it was, or start a new run from another base "
        "(checkpoint.resume=none, or another output_dir)")


def check_base(reference: dict, checkpoint: Path, checksums: bool = True,
               checked_on_load: tuple[str, ...] = ()) -> Path:
    """The base directory, or ConfigError naming what changed (base_problem)."""
    problem = base_problem(reference, checkpoint, checksums, checked_on_load)
    if problem:
        raise refused(checkpoint, problem)
    return locate(reference, checkpoint)
