"""Load an HF safetensors checkpoint straight into a sharded Megatron model.

Each rank reads only the slices its own parameters need (`safe_open(...).get_slice`), never the
whole checkpoint. Before any parameter is written, every rank checks the names and full shapes
it needs against the checkpoint's metadata, and the union of all ranks' needs is compared with
the checkpoint's contents, so a missing tensor, an unexpected tensor or a shape mismatch is
reported by name and nothing is half-loaded. A file that cannot be read (truncated, not
safetensors) or whose values are NaN/infinite is reported by path, with what to do.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from megatron_rl.bridge.layouts import merge, piece_rows
from megatron_rl.bridge.mappings import expand
from megatron_rl.bridge.placement import Placement, placements
from megatron_rl.config import ConfigError
from megatron_rl.model.hf_config import ArchitectureSpec

# Tensors some checkpoints carry that are not parameters of the model.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointMismatch(ConfigError):
    """The HF checkpoint does not fit the model: names the tensors and shapes involved."""


class CheckpointUnreadable(CheckpointMismatch):
    """A file of the HF checkpoint is truncated, corrupt or missing: names the file."""


REDOWNLOAD = "download the model again (or copy the file again from an intact copy)"


def open_safetensors(file: Path):
    """safe_open, with a one-line error naming the file instead of the Rust library's message alone
    (a truncated download fails here: the header promises more bytes than the file has)."""
    try:
        return safe_open(str(file), "pt")
    except (SafetensorError, OSError) as exc:
        if not file.is_file():
            raise CheckpointUnreadable(f"{file} is missing: {REDOWNLOAD}") from None
        raise CheckpointUnreadable(f"{file} cannot be read as safetensors ({exc}); the file is truncated "
                                   f"or corrupt: {REDOWNLOAD}") from None


def checkpoint_index(hf_dir: str | Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file holding it."""
    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointUnreadable(f"{index} is not a safetensors index ({exc!r}): {REDOWNLOAD}") from None
        return {name: hf_dir / file for name, file in weight_map.items()}
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointMismatch(f"{hf_dir} holds no *.safetensors files")
    located = {}
    for file in files:
        with open_safetensors(file) as handle:
            located.update({name: file for name in handle.keys()})
    return located


def check_files(hf_dir: str | Path) -> None:
    """Every safetensors file of the checkpoint opens (its header is whole): a truncated download
    is named before any process starts."""
    for file in sorted(set(checkpoint_index(hf_dir).values())):
        with open_safetensors(file):
            pass


def non_finite(tensor: torch.Tensor) -> bool:
    """True if any value is NaN or infinite (isfinite has no 8-bit float kernels: widen those)."""
    if not tensor.is_floating_point():
        return False
    if tensor.element_size() == 1:
        tensor = tensor.float()
    return not bool(torch.isfinite(tensor).all())


def load_hf_weights(module, arch: ArchitectureSpec, hf_dir: str | Path) -> None:
    table = {name: (hf, layout) for name, hf, layout in expand(arch)}
    located = checkpoint_index(hf_dir)
    plans = []
    needed: set[str] = set()
    with ExitStack() as stack:
        handles: dict[Path, object] = {}

        def tensor_slice(name: str):
            file = located[name]
            if file not in handles:
                handles[file] = stack.enter_context(open_safetensors(file))
            return handles[file].get_slice(name)

        error = None
        try:
            for placement in placements(module):
                if placement.global_name not in table:
                    if arch.tie_word_embeddings and placement.global_name == "output_layer.weight":
                        continue  # shares the embedding's weight
                    raise CheckpointMismatch(f"Megatron parameter {placement.global_name} has no HF mapping")
                hf_names, layout = table[placement.global_name]
                missing = [n for n in hf_names if n not in located]
                if missing:
                    raise CheckpointMismatch(
                        f"{hf_dir}: tensor {missing[0]} is missing (needed for {placement.global_name})"
                    )
                needed.update(hf_names)
                plans.append((placement, hf_names, layout, _slices(placement, hf_names, layout, arch, tensor_slice)))
        except CheckpointMismatch as exc:
            error = str(exc)
        # Every rank learns every rank's verdict, so all raise together instead of some waiting.
        _check_all_ranks(located, needed, error, hf_dir, arch)
        error = None
        with torch.no_grad():
            for placement, hf_names, layout, slices in plans:
                pieces = [tensor_slice(name)[index] for name, index in zip(hf_names, slices)]
                error = error or _non_finite_piece(hf_names, pieces, located)
                value = merge(layout, pieces, arch)
                if layout == "vocab":
                    value = _pad_rows(value, placement.param.shape[0])
                placement.param.copy_(value.to(placement.param.dtype))
        # The values are only seen while copying, each rank its own slices: agree before returning.
        error = first_error(error)
        if error:
            raise CheckpointUnreadable(error)


def _non_finite_piece(hf_names, pieces, located: dict) -> str | None:
    """Safetensors carries no checksum; NaN/infinite weights are the damage that can be seen."""
    for name, piece in zip(hf_names, pieces):
        if non_finite(piece):
            return (f"{located[name]}: tensor {name} holds NaN or infinite values: the file is corrupt or "
                    f"the model itself is broken; {REDOWNLOAD}")
    return None


def first_error(error: str | None) -> str | None:
    """Collective: the first rank's error, on every rank (None if no rank has one)."""
    everyone = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, error)
    return next((e for e in everyone if e), None)


def _slices(placement: Placement, hf_names, layout, arch, tensor_slice) -> list[tuple[slice, ...]]:
    """Check every piece's full shape and return this rank's slice of each."""
    shape = tuple(placement.param.shape)
    dim = placement.tp_dim
    size = placement.tp_group.size() if dim is not None else 1
    rank = placement.tp_group.rank() if dim is not None else 0
    if layout == "vocab":
        rows_local = shape[0]
        start = rank * rows_local if dim == 0 else 0
        stop = min(start + rows_local, arch.vocab_size)
        expected = [(arch.vocab_size, *shape[1:])]
        index = [(slice(start, max(start, stop)),)]
    else:
        rows = piece_rows(layout, shape[0], arch)
        expected, index = [], []
        for piece_rows_local in rows:
            local = (piece_rows_local, *shape[1:])
            full = tuple(n * size if d == dim else n for d, n in enumerate(local))
            expected.append(full)
            index.append(tuple(slice(rank * n, (rank + 1) * n) if d == dim else slice(None) for d, n in enumerate(local)))
    for name, want in zip(hf_names, expected):
        got = tuple(tensor_slice(name).get_shape())
        if got != want:
            raise CheckpointMismatch(
                f"tensor {name} has shape {list(got)} in the checkpoint but the model needs {list(want)} "
                f"(for {placement.global_name})"
            )
    return index


def _check_all_ranks(located: dict, needed: set[str], error: str | None, hf_dir, arch: ArchitectureSpec) -> None:
    everyone = [(needed, error)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (needed, error))
    errors = [e for _, e in everyone if e]
    if errors:
        raise CheckpointMismatch(errors[0])
    used = set().union(*(n for n, _ in everyone))
    ignored = {n for n in located if n.endswith(IGNORED_SUFFIXES)}
    if arch.tie_word_embeddings:
        ignored.add("lm_head.weight")  # some tied checkpoints store the shared matrix twice
    extra = sorted(set(located) - used - ignored)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointMismatch(f"{hf_dir}: tensor {extra[0]}{more} is not used by {arch.architecture}")


def _pad_rows(value: torch.Tensor, rows: int) -> torch.Tensor:
    if value.shape[0] == rows:
        return value
    padded = value.new_zeros((rows, *value.shape[1:]))
    padded[: value.shape[0]] = value
    return padded
