"""Nothing in a checkpoint is unpickled as code.

A pickle may name any importable callable and call it while it loads, so a checkpoint file
crafted by whoever could write to the run directory would run its payload on resume (the audit
made `rng/rank_00000.pt`, manifest CRC recomputed, create a file). Every pickle megatron-rl or
its loaders read from a checkpoint therefore goes through one of these:

* the RNG states (`rng/rank_*.pt`): `torch.load(weights_only=True)`; they are written as tensors
  and plain values. Files written before that hold numpy's generator state as an ndarray: those
  load only if the pickle names nothing but numpy's array rebuild (read without unpickling first).
* the torch_dist index (`weights/.metadata`, which torch.distributed.checkpoint reads with plain
  `pickle.load`): unpickled here with only torch.distributed.checkpoint's metadata classes,
  torch dtypes, sizes and paths allowed (INDEX_GLOBALS); anything else is refused before torch
  or Megatron-Core open it.
* the pickled objects inside the .distcp files (torch.distributed.checkpoint loads them with
  `weights_only=False`) and Megatron-Core's `common.pt`: each is scanned without unpickling and
  refused if it names a callable beyond what `torch.load(weights_only=True)` allows.

A refusal is a ConfigError naming the file and what it would have called.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_rl.errors import ConfigError

INDEX = ".metadata"
COMMON = "common.pt"
# What the torch_dist index of torch.distributed.checkpoint (as Megatron-Core writes it) names.
_DCP = "torch.distributed.checkpoint"
INDEX_GLOBALS = {
    ("pathlib", "PosixPath"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"), (f"{_DCP}.filesystem", "_StorageInfo"),
    *((f"{_DCP}.metadata", name) for name in (
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    *((f"{_DCP}.planner", name) for name in ("SavePlan", "TensorWriteData", "WriteItem", "WriteItemType")),
}
# numpy's ndarray rebuild: what an RNG file written before the plain format needs, and all it may name.
_RECONSTRUCT = np.zeros(0).__reduce__()[0]
LEGACY_RNG_GLOBALS = {f"{_RECONSTRUCT.__module__}.{_RECONSTRUCT.__name__}", "numpy.ndarray", "numpy.dtype"}
ADVICE = ("megatron-rl never writes that: the file was altered or does not come from megatron-rl. Delete that "
          "checkpoint (or resume from another, checkpoint.resume=PATH) unless you know who wrote it")


def refused(path: Path, what: str) -> ConfigError:
    return ConfigError(f"{path}: refused: it holds {what}, which loading it would run as code; {ADVICE}")


# ---- RNG states ---------------------------------------------------------------------------------


def read_rng_state(path: Path) -> dict[str, Any]:
    """An RNG state file: tensors and plain values only (weights_only), or the older form with
    numpy arrays and nothing else."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        pass
    found = _unsafe_globals(path)
    if not found or not found <= LEGACY_RNG_GLOBALS:
        raise refused(path, f"the callables {sorted(found)}" if found else "pickle instructions that name callables")
    # (np.dtype("u4") is rebuilt as an instance of its own dtype class, which BUILD then sets up)
    with torch.serialization.safe_globals([_RECONSTRUCT, np.ndarray, np.dtype, type(np.dtype(np.uint32))]):
        return torch.load(path, weights_only=True)


def _unsafe_globals(source) -> set[str]:
    """The callables a torch.save file names beyond weights_only's own, read without unpickling it;
    {"<unreadable>"} when the scan meets an instruction it does not know (INST, EXT, protocol 4)."""
    try:
        return set(torch.serialization.get_unsafe_globals_in_checkpoint(source))
    except Exception:  # an instruction the scanner does not read, or not a torch.save file at all
        return {"<unreadable>"}


# ---- torch_dist ---------------------------------------------------------------------------------


class _Forbidden(pickle.UnpicklingError):
    """The index names a callable that is not one of INDEX_GLOBALS."""


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in INDEX_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _Forbidden(f"{module}.{name}")


def read_torch_dist_index(weights: Path):
    """The index of a torch_dist directory (torch.distributed.checkpoint's Metadata), unpickled
    with only its own classes allowed. ConfigError when it names anything else; the unpickler's
    own error (OSError, UnpicklingError, EOFError, ...) when it is missing or damaged."""
    path = Path(weights) / INDEX
    try:
        with open(path, "rb") as handle:
            return _IndexUnpickler(handle).load()
    except _Forbidden as exc:
        raise refused(path, f"the callable {exc}") from None


def check_torch_dist_pickles(weights: Path, index) -> None:
    """Refuse a pickled object among the weights (and Megatron-Core's common.pt) that names a
    callable weights_only would not allow: torch.distributed.checkpoint unpickles them in full."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    weights = Path(weights)
    if (weights / COMMON).is_file():
        found = _unsafe_globals(weights / COMMON)
        if found:
            raise refused(weights / COMMON, f"the callables {sorted(found)}")
    for key, item in index.storage_data.items():
        if not isinstance(index.state_dict_metadata.get(key.fqn), BytesStorageMetadata):
            continue
        file = weights / item.relative_path
        with open(file, "rb") as handle:
            handle.seek(item.offset)
            found = _unsafe_globals(io.BytesIO(handle.read(item.length)))
        if found:
            raise refused(file, f"an object {key.fqn} naming the callables {sorted(found)}")
