"""The frozen base a LoRA run's checkpoints refer to: which one it is, and writing it when nothing
else holds it (the reference's format and its checks: checkpoint/base_check.py).

The base is checkpoint.init_from as the run read it at its start (a Hugging Face directory or a
megatron-rl checkpoint; a run directory is pinned to the step it named then, not to `latest`),
or, for a run from random initialization, OUTPUT_DIR/checkpoints/base/: the base written once at
the start as a plain megatron-rl checkpoint (no adapters), named relative to the step
directories so that the run directory may move. Its `files` are its content when the run read it:
a manifest's entries (each checked to lie inside the base when it is read: checkpoint/store.py
read_manifest), or, for a Hugging Face directory without one, its model files and every file
its safetensors index names (bridge/importer.py refuses an index naming files outside it).
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_rl.checkpoint.base_check import locate, refers_to_base
from megatron_rl.errors import ConfigError

BASE_DIR = "base"  # in OUTPUT_DIR/checkpoints/: the base of a run from random initialization
# The files of a Hugging Face directory that make the model: weights, configs, tokenizer (not a
# README, a licence, a download's caches and locks).
_MODEL_FILES = (".safetensors", ".json", ".model", ".txt", ".jinja", ".tiktoken")


def describe_source(source: str | Path) -> dict:
    """The reference to checkpoint.init_from as a LoRA run's base (read it after loading it: a
    manifest it carries has been verified then, and its recorded checksums are used). A
    checkpoint that itself refers to a base gives that base: its adapters become the new run's
    starting adapters, saved in each of its checkpoints."""
    from megatron_rl.checkpoint.format import (
        MANIFEST, names_megatron_checkpoint, read_metadata, resolve_checkpoint,
    )
    from megatron_rl.checkpoint.store import read_manifest

    if names_megatron_checkpoint(source):
        ckpt = resolve_checkpoint(source).resolve()
        metadata = read_metadata(ckpt)
        if refers_to_base(metadata):
            return dict(metadata["base"], path=str(locate(metadata["base"], ckpt).resolve()))
        kind, files = "megatron", None
    else:
        ckpt, kind, files = Path(source).resolve(), "hf", None
    if (ckpt / MANIFEST).is_file():
        files = read_manifest(ckpt)
        # An older manifest lists sizes alone: the reference needs every file's CRC-32 too.
        files.update(_inventory([ckpt / name for name, entry in files.items() if not isinstance(entry, dict)
                                 or "crc32" not in entry], ckpt))
    elif kind == "hf":
        from megatron_rl.bridge.importer import INDEX, checkpoint_index

        model_files = {p for p in ckpt.iterdir() if p.is_file() and p.name.endswith(_MODEL_FILES)
                       and not p.name.startswith(".")}
        if (ckpt / INDEX).is_file():  # every file it names: the loader reads those
            model_files |= set(checkpoint_index(ckpt).values())
        files = _inventory(sorted(model_files), ckpt)
    else:
        files = _inventory([p for p in sorted(ckpt.rglob("*")) if p.is_file()], ckpt)
    return {"path": str(ckpt), "kind": kind, "files": files}


def describe_written(base: Path, relative_to: Path) -> dict:
    """The reference to a base this run wrote (write_base), by its path relative to `relative_to`
    (the checkpoints directory's step folders are one level below it)."""
    from megatron_rl.checkpoint.store import read_manifest

    return {"path": os.path.relpath(base, relative_to), "kind": "megatron", "files": read_manifest(base)}


def write_base(policy, root: Path, config, model_dir: Path | None) -> Path:
    """Collective: the frozen base of a run from random initialization as a megatron-rl checkpoint
    ROOT/base (weights without adapters, hf_config/ with `model_dir`'s tokenizer files,
    megatron_rl.json, MANIFEST.json). A base already there is never replaced (checkpoints may
    refer to it): this one is then written beside it as ROOT/base-<id>."""
    import uuid

    import torch.distributed as dist

    from megatron_rl.checkpoint.atomic_dir import AtomicDirectory
    from megatron_rl.checkpoint.format import save_megatron_checkpoint
    from megatron_rl.checkpoint.store import write_manifest

    name = [BASE_DIR if not (Path(root) / BASE_DIR).exists() else f"{BASE_DIR}-{uuid.uuid4().hex[:8]}"]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(name, src=0)
    target = Path(root) / name[0]
    with AtomicDirectory(target) as staging:
        save_megatron_checkpoint(policy.module, policy.raw_hf_config, staging, config, tokenizer_dir=model_dir,
                                 source="the run's initial weights (the frozen base of its LoRA adapters)",
                                 without_adapters=True)
        if dist.is_initialized():
            dist.barrier()  # every rank's files are written
        if not dist.is_initialized() or dist.get_rank() == 0:
            write_manifest(staging)
    return target


def _inventory(files: list[Path], root: Path) -> dict[str, dict]:
    """{relative name: {"bytes", "crc32"}}; a file whose symbolic link leads out of `root` is
    refused (the reference would record, and later loads check, a file the base does not hold)."""
    from megatron_rl.bridge.checked_read import outside
    from megatron_rl.checkpoint.store import file_crc32

    inventory = {}
    for path in files:
        relative = str(path.relative_to(root))
        problem = outside(root, relative)
        if problem:
            raise ConfigError(f"checkpoint.init_from {root}: {relative} {problem}; a LoRA run's base must hold its "
                              "own files (copy them into it)")
        inventory[relative] = {"bytes": path.stat().st_size, "crc32": file_crc32(path)}
    return inventory
