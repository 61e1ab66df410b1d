"""The frozen base model that a LoRA run's checkpoints refer to instead of holding it.

Under model.lora only the adapters train; the base weights are the initial weights for the
whole run, and at 30B-1T parameters they are nearly all of a checkpoint. With
checkpoint.base_weights=referenced (the default) a LoRA run's checkpoint holds the adapters,
their optimizer state, the state buffers (the routers' expert bias), the KL reference's
adapters and the run state; its megatron_rl.json names the base:

    "base": {"path": "../base" or an absolute path, "kind": "megatron" | "hf",
             "files": {relative path: {"bytes": N, "crc32": "..."}}}

The base is checkpoint.init_from as the run read it at its start (a Hugging Face directory or a
megatron-rl checkpoint; a run directory is pinned to the step it named then, not to `latest`),
or, for a run from random initialization, OUTPUT_DIR/checkpoints/base/: the base written once at
the start as a plain megatron-rl checkpoint (no adapters), named relative to the step
directories so that the run directory may move. `files` is the base's content when the run
read it. Before a checkpoint's base is loaded (resume, init_from, conversion) every recorded
file is compared with it, sizes first, then CRC-32; a difference is refused naming the file:
the adapters were trained on that base and mean something else on another.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_rl.errors import ConfigError

BASE_DIR = "base"  # in OUTPUT_DIR/checkpoints/: the base of a run from random initialization
# The files of a Hugging Face directory that make the model: weights, configs, tokenizer (not a
# README, a licence, a download's caches and locks).
_MODEL_FILES = (".safetensors", ".json", ".model", ".txt", ".jinja", ".tiktoken")


def refers_to_base(metadata) -> bool:
    """Whether a checkpoint (its megatron_rl.json) holds everything but a base it refers to."""
    return isinstance(metadata, dict) and "base" in metadata


def base_loaded_first(policy, ckpt: Path, weights: Path) -> bool:
    """Collective, for a megatron-rl checkpoint about to be loaded into `policy`: a LoRA run's
    checkpoint is refused by a model without adapters (it would load the base alone); one that
    refers to its base has the base loaded now (True: load the checkpoint's tensors over it)."""
    from megatron_rl.checkpoint.format import read_metadata

    _refuse_dropped_adapters(policy, ckpt, weights)
    metadata = read_metadata(ckpt)
    if refers_to_base(metadata):
        load_base(policy, metadata["base"], ckpt)
    return refers_to_base(metadata)


def _refuse_dropped_adapters(policy, ckpt: Path, weights: Path) -> None:
    from megatron_rl.checkpoint.unpickling import read_torch_dist_index
    from megatron_rl.model.state import is_adapter

    if any(is_adapter(name) for name, _ in policy.module.named_parameters()):
        return
    if any(is_adapter(index.fqn.split("/")[0]) for index in read_torch_dist_index(weights).storage_data):
        raise ConfigError(f"{ckpt} holds LoRA adapters, and the model built to load it has none (no model.lora): "
                          "it would be the base model without them. Export the merged model "
                          "(`megatron-rl convert megatron-to-hf --merge-lora`) and load that, or build the model "
                          "with the model.lora of the run that wrote the checkpoint")


def describe_source(source: str | Path) -> dict:
    """The reference to checkpoint.init_from as a LoRA run's base (read it after loading it: a
    manifest it carries has been verified then, and its recorded checksums are used). A
    checkpoint that itself refers to a base gives that base: its adapters become the new run's
    starting adapters, saved in each of its checkpoints."""
    from megatron_rl.checkpoint.format import (
        MANIFEST, names_megatron_checkpoint, read_metadata, resolve_checkpoint,
    )

    if names_megatron_checkpoint(source):
        ckpt = resolve_checkpoint(source).resolve()
        metadata = read_metadata(ckpt)
        if refers_to_base(metadata):
            return dict(metadata["base"], path=str(locate(metadata["base"], ckpt).resolve()))
        kind, files = "megatron", None
    else:
        ckpt, kind, files = Path(source).resolve(), "hf", None
    manifest = ckpt / MANIFEST
    if manifest.is_file():
        files = json.loads(manifest.read_text())["files"]
    elif kind == "hf":
        files = _inventory([p for p in sorted(ckpt.iterdir()) if p.is_file() and p.name.endswith(_MODEL_FILES)
                            and not p.name.startswith(".")], ckpt)
    else:
        files = _inventory([p for p in sorted(ckpt.rglob("*")) if p.is_file()], ckpt)
    return {"path": str(ckpt), "kind": kind, "files": files}


def describe_written(base: Path, relative_to: Path) -> dict:
    """The reference to a base this run wrote (write_base), by its path relative to `relative_to`
    (the checkpoints directory's step folders are one level below it)."""
    from megatron_rl.checkpoint.format import MANIFEST

    files = json.loads((base / MANIFEST).read_text())["files"]
    return {"path": os.path.relpath(base, relative_to), "kind": "megatron", "files": files}


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


def base_problem(reference: dict, checkpoint: Path, checksums: bool = True) -> str | None:
    """None if the base `checkpoint` refers to is there as the run read it, else what differs
    (naming the file). `checksums=False`: sizes only (fast: a preflight)."""
    from megatron_rl.checkpoint.store import file_crc32

    malformed = _malformed(reference)
    if malformed:
        return f"its megatron_rl.json names the base wrongly ({malformed}); the file was edited or damaged"
    base = locate(reference, checkpoint)
    if not base.is_dir():
        return f"the base model {base} it refers to does not exist (moved or deleted?)"
    for relative, entry in sorted(reference["files"].items()):
        file = base / relative
        if not file.is_file():
            return f"the base model {base} it refers to has changed: {relative} is missing"
        if file.stat().st_size != entry["bytes"]:
            return (f"the base model {base} it refers to has changed: {relative} has {file.stat().st_size} bytes, "
                    f"{entry['bytes']} when the run read it")
        if checksums and file_crc32(file) != entry["crc32"]:
            return (f"the base model {base} it refers to has changed: {relative} has CRC-32 {file_crc32(file)}, "
                    f"{entry['crc32']} when the run read it")
    return None


def _malformed(reference) -> str | None:
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


def check_base(reference: dict, checkpoint: Path, checksums: bool = True) -> Path:
    """The base directory, or ConfigError naming what changed."""
    problem = base_problem(reference, checkpoint, checksums)
    if problem:
        raise refused(checkpoint, problem)
    return locate(reference, checkpoint)


def load_base(policy, reference: dict, checkpoint: Path) -> None:
    """Collective: the base `checkpoint` refers to, checked (global rank 0 reads it, every rank
    gets the verdict), into `policy`. The checkpoint's own tensors go over it afterwards."""
    from megatron_rl.checkpoint.format import load_initial_weights, on_rank0_shared

    on_rank0_shared(check_base, reference, checkpoint)
    # The check above compared every file's CRC-32 with the one recorded when the run first read
    # (and verified) the base: the same files, so its manifest is not read a second time.
    load_initial_weights(policy, locate(reference, checkpoint), checked=True)


def write_base(policy, root: Path, config, model_dir: Path) -> Path:
    """Collective: the frozen base of a run from random initialization as a megatron-rl checkpoint
    ROOT/base (weights without adapters, hf_config/, megatron_rl.json, MANIFEST.json). A base
    already there is never replaced (checkpoints may refer to it): this one is then written
    beside it as ROOT/base-<id>."""
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
    from megatron_rl.checkpoint.store import file_crc32

    return {str(p.relative_to(root)): {"bytes": p.stat().st_size, "crc32": file_crc32(p)} for p in files}
