"""Load an HF safetensors checkpoint straight into a sharded Megatron model.

Each rank reads only the slices its own parameters need (`safe_open(...).get_slice`), never the
whole checkpoint. Before any parameter is written, every rank checks the names and full shapes
it needs against the checkpoint's metadata, and the union of all ranks' needs is compared with
the checkpoint's contents, so a missing tensor, an unexpected tensor or a shape mismatch is
reported by name and nothing is half-loaded. A file that cannot be read (truncated, not
safetensors) or whose values are NaN/infinite is reported by path, with what to do.

Block-wise FP8 checkpoints (DeepSeek-V3/R1, Kimi-K2, and our own `model.export_fp8` exports;
`arch.fp8_block` from config.json's quantization_config) are dequantized while loading: a
float8_e4m3fn `<name>` is read with its float32 `<name>_scale_inv` ([ceil(rows / block_rows),
ceil(cols / block_cols)], one scale per block, the last block of a dimension possibly partial)
and becomes fp8 * scale in float32, then the parameter's dtype. Each rank reads only its own
rows and columns of the weight and the scales of the blocks they touch. The scales count as
used; a 1-byte weight without its scale, or without a quantization_config, is refused by name.
The shape and NaN/infinity checks apply to the weight, its scale and the dequantized values.

Weights are read from the model's own directory only: an index entry, or a *.safetensors file,
that leads outside it (`..`, an absolute path, a symbolic link) is refused by name. With a record
of the files' checksums (a LoRA checkpoint's base: bridge/checked_read.py), each file is read
front to back once, its CRC-32 taken on the bytes that are loaded (`load_hf_weights(...,
recorded)`), so a file rewritten after it was checked cannot be loaded.

Multi-token-prediction layers (DeepSeek-V3's `num_nextn_predict_layers`, stored after the
decoder layers as `model.layers.{num_hidden_layers + i}.*`) are not built: their tensors are
skipped with one message instead of being refused as unused.
"""

from __future__ import annotations

import json
import re
import struct
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from megatron_rl.bridge.fp8_export import SCALE_SUFFIX, dequantize_blockwise
from megatron_rl.bridge.layouts import merge, piece_rows
from megatron_rl.bridge.mappings import expand
from megatron_rl.bridge.placement import Placement, placements
from megatron_rl.bridge.safetensors_stream import TORCH_DTYPES
from megatron_rl.bridge.checked_read import CheckedFile, Recorded, outside
from megatron_rl.errors import ConfigError
from megatron_rl.model.hf_config import ArchitectureSpec

# Tensors some checkpoints carry that are not parameters of the model.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Decoder layers on disk, numbered from 0; multi-token-prediction layers follow the last one
# (DeepSeek-V3 checkpoints; the mapping tables never name them because they are not built).
HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# safetensors dtype names of 1-byte tensors: quantized weights, never usable without their scales.
ONE_BYTE_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "I8", "U8")
FP8_DTYPE = "F8_E4M3"
# Tied embeddings: one stage holds both ends of the model and shares one matrix (no output
# parameter exists), but at PP > 1 Megatron keeps a second copy of the shared matrix as the last
# stage's output layer (the embedding group's all-reduce keeps the two equal). That copy is
# filled from the embedding, the tensor transformers itself ties the output to (a checkpoint
# that also stores lm_head.weight has it ignored, as transformers ignores it).
TIED_OUTPUT = "output_layer.weight"
TIED_SOURCE = "embedding.word_embeddings.weight"


class CheckpointMismatch(ConfigError):
    """The HF checkpoint does not fit the model: names the tensors and shapes involved."""


class CheckpointUnreadable(CheckpointMismatch):
    """A file of the HF checkpoint is truncated, corrupt or missing: names the file."""


REDOWNLOAD = "download the model again (or copy the file again from an intact copy)"
INDEX = "model.safetensors.index.json"
OWN_DIRECTORY = ("a model's weights are read from its own directory only: copy the files into it (a Hugging Face "
                 "cache's snapshot links to blobs outside it: download with --local-dir instead)")


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


def checkpoint_index(hf_dir: str | Path, recorded: Recorded | None = None) -> dict[str, Path]:
    """HF tensor name -> safetensors file holding it, every one inside `hf_dir` (an index entry
    or a file leading outside is refused naming the index, the tensor and the entry). Every
    reader of a HF directory's weights finds them here. `recorded`: the index is read checked."""
    hf_dir = Path(hf_dir)
    index = hf_dir / INDEX
    if index.is_file():
        text = index.read_bytes() if recorded is None else bytes(CheckedFile(recorded, index).whole())
        try:
            weight_map = json.loads(text)["weight_map"]
            entries = list(weight_map.items())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # ValueError: bad JSON, not UTF-8
            raise CheckpointUnreadable(f"{index} is not a safetensors index ({exc!r}): {REDOWNLOAD}") from None
        located = {}
        for name, file in entries:
            problem = outside(hf_dir, file)
            if problem:
                raise CheckpointUnreadable(f"{index}: tensor {name} is mapped to {file!r}, which {problem}; "
                                           f"{OWN_DIRECTORY}")
            located[name] = hf_dir / file
        return located
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointMismatch(f"{hf_dir} holds no *.safetensors files")
    located = {}
    for file in files:
        problem = outside(hf_dir, file.name)
        if problem:
            raise CheckpointUnreadable(f"{hf_dir}: weight file {file.name} {problem}; {OWN_DIRECTORY}")
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
    """True if any value is NaN or infinite (8-bit floats have no kernels for this: widened).
    The smallest and largest values tell (NaN propagates, infinities are extremes): one pass
    without a flag per value, 40x faster than isfinite(tensor).all() on the CPU."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return False
    if tensor.element_size() == 1:
        tensor = tensor.float()
    low, high = torch.aminmax(tensor)
    return not bool(torch.isfinite(low) and torch.isfinite(high))


def load_hf_weights(module, arch: ArchitectureSpec, hf_dir: str | Path, recorded: Recorded | None = None) -> None:
    """Every parameter of this rank's (built) model from the HF checkpoint. Collective.
    `recorded`: the files' sizes and CRC-32s, compared on the bytes loaded (module docstring)."""
    with HfWeights(module, arch, hf_dir, recorded) as weights, torch.no_grad():
        error = None
        for placement in weights.in_file_order():
            try:
                placement.param.copy_(weights.read(placement))
            except ConfigError as exc:  # CheckpointUnreadable, or a file that differs from the record
                error = str(exc)
                break
        # The values are only seen while reading, each rank its own slices: agree before returning.
        error = first_error(error)
        if error:
            raise CheckpointUnreadable(error)


class HfWeights:
    """The HF checkpoint's values of this rank's parameters, one parameter at a time.

    Entering it is collective: every rank checks the names and full shapes it needs against the
    checkpoint's metadata, and the union of all ranks' needs is compared with the checkpoint's
    contents (CheckpointMismatch, naming the tensor, on every rank together). Nothing is read
    then: `read(placement)` reads that parameter's slices and returns its value, in the
    parameter's dtype and shape, and works as well on a model built on the meta device (the
    streamed conversion, bridge/streamed.py, reads each parameter only while writing it). A
    value that is NaN or infinite raises CheckpointUnreadable naming the file, on that rank only.

    `recorded`: the values are read from each file front to back once, its CRC-32 compared with
    the record (bridge/checked_read.py), the tensors this rank needs kept until the
    placements that use them are read; read the placements in_file_order() (a file that differs
    raises ConfigError naming it, on that rank only). Without: from safe_open's mapping of the files.
    """

    def __init__(self, module, arch: ArchitectureSpec, hf_dir: str | Path, recorded: Recorded | None = None):
        self.module, self.arch, self.hf_dir, self.recorded = module, arch, hf_dir, recorded
        self.placements: list[Placement] = []
        self._plans: dict[str, tuple] = {}  # global name -> (hf names, layout, slices, scales)
        self._handles: dict[Path, object] = {}
        self._stack = ExitStack()
        self._checked: dict[Path, dict[str, _Loaded]] = {}  # recorded: a file's tensors read and checked
        self._users: dict[Path, int] = {}  # recorded: the placements not yet read that need the file

    def __enter__(self) -> "HfWeights":
        self._located = checkpoint_index(self.hf_dir, self.recorded)
        try:
            self._plan()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _tensor_slice(self, name: str):
        file = self._located[name]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(open_safetensors(file))
        return self._handles[file].get_slice(name)

    def _plan(self) -> None:
        arch, located = self.arch, self._located
        table = {name: (hf, layout) for name, hf, layout in expand(arch)}
        needed: set[str] = set()
        error = None
        try:
            for placement in placements(self.module):
                if placement.global_name in table:
                    hf_names, layout = table[placement.global_name]
                elif arch.tie_word_embeddings and placement.global_name == TIED_OUTPUT:
                    hf_names, layout = table[TIED_SOURCE]
                else:
                    raise CheckpointMismatch(f"Megatron parameter {placement.global_name} has no HF mapping")
                missing = [n for n in hf_names if n not in located]
                if missing:
                    raise CheckpointMismatch(
                        f"{self.hf_dir}: tensor {missing[0]} is missing (needed for {placement.global_name})"
                    )
                slices = _slices(placement, hf_names, layout, arch, self._tensor_slice)
                scales = [_scale_name(name, arch, located, self._tensor_slice, self.hf_dir) for name in hf_names]
                needed.update(hf_names)
                needed.update(scale for scale in scales if scale)
                self.placements.append(placement)
                self._plans[placement.global_name] = (hf_names, layout, slices, scales)
        except CheckpointMismatch as exc:
            error = str(exc)
        # Every rank learns every rank's verdict, so all raise together instead of some waiting.
        _check_all_ranks(located, needed, error, self.hf_dir, arch)

    def _needs(self, placement: Placement) -> list[str]:
        """The HF tensors `placement` is read from: its pieces and their scales."""
        hf_names, _, _, scales = self._plans[placement.global_name]
        return [*hf_names, *filter(None, scales)]

    def _files(self, placement: Placement) -> list[Path]:
        return sorted({self._located[name] for name in self._needs(placement)})

    def in_file_order(self) -> list[Placement]:
        """The placements ordered by the files they read, so that with a record each file is read
        once and its tensors are let go once the last placement that needs them is read."""
        ordered = sorted(self.placements, key=self._files)
        self._users = {}
        for placement in ordered:
            for file in self._files(placement):
                self._users[file] = self._users.get(file, 0) + 1
        return ordered

    def _checked_slice(self, name: str):
        file = self._located[name]
        if file not in self._checked:
            wanted = {n for placement in self.placements for n in self._needs(placement) if self._located[n] == file}
            self._checked[file] = read_checked_tensors(file, wanted, self.recorded, self._tensor_slice)
        return self._checked[file][name]

    def read(self, placement: Placement) -> torch.Tensor:
        hf_names, layout, slices, scales = self._plans[placement.global_name]
        source = self._tensor_slice if self.recorded is None else self._checked_slice
        pieces = [_read(name, index, scale, self.arch, source)
                  for name, index, scale in zip(hf_names, slices, scales)]
        if self.recorded is not None:
            for file in self._files(placement):
                self._users[file] = self._users.get(file, 1) - 1
                if self._users[file] <= 0:
                    self._checked.pop(file, None)
        error = _non_finite_piece(hf_names, pieces, self._located, scales)
        if error:
            raise CheckpointUnreadable(error)
        value = merge(layout, pieces, self.arch)
        if layout == "vocab":
            value = _pad_rows(value, placement.param.shape[0])
        return value.to(placement.param.dtype)


class _Loaded:
    """A tensor read whole, served as safe_open serves a slice: get_dtype, get_shape, [index]."""

    def __init__(self, tensor: torch.Tensor, dtype: str):
        self.tensor, self.dtype = tensor, dtype

    def get_dtype(self) -> str:
        return self.dtype

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


def read_checked_tensors(file: Path, names: set[str], recorded: Recorded, planned) -> dict[str, _Loaded]:
    """The tensors `names` of safetensors `file`, read front to back once with the file's size and
    CRC-32 compared with `recorded` (ConfigError naming the file when they differ). `planned(name)`:
    the slice the load was planned with; a tensor whose dtype or shape is not the planned one was
    changed between planning and reading, and is refused."""
    checked = CheckedFile(recorded, file)
    try:
        size = struct.unpack("<Q", checked.read_at(0, 8))[0]
        if 8 + size > checked.entry["bytes"]:
            raise ValueError(f"a header of {size} bytes")
        header = json.loads(bytes(checked.read_at(8, size)))
        found = {}
        for name in sorted(names, key=lambda n: header[n]["data_offsets"][0]):
            entry = header[name]
            start, end = entry["data_offsets"]
            if not 0 <= start <= end <= checked.entry["bytes"] - 8 - size:
                raise ValueError(f"tensor {name} at bytes {start}..{end}")
            want = planned(name)
            if entry["dtype"] != want.get_dtype() or list(entry["shape"]) != list(want.get_shape()):
                raise recorded.refuse(f"{checked.relative} changed while it was loaded (tensor {name}: "
                                      f"{entry['dtype']} {entry['shape']}, planned as {want.get_dtype()} "
                                      f"{list(want.get_shape())})")
            data = checked.read_at(8 + size + start, end - start)
            tensor = (torch.frombuffer(data, dtype=TORCH_DTYPES[entry["dtype"]]) if data else
                      torch.empty(0, dtype=TORCH_DTYPES[entry["dtype"]]))
            found[name] = _Loaded(tensor.reshape(entry["shape"]), entry["dtype"])
        checked.finish()
    except (ValueError, KeyError, TypeError, RuntimeError, struct.error) as exc:
        if isinstance(exc, ConfigError):
            raise
        checked.finish()  # a file that is not the recorded one is named as such
        raise CheckpointUnreadable(f"{file} cannot be read as safetensors ({exc!r}); the file is truncated "
                                   f"or corrupt: {REDOWNLOAD}") from None
    finally:
        checked.close()
    return found


def _non_finite_piece(hf_names, pieces, located: dict, scales) -> str | None:
    """Safetensors carries no checksum; NaN/infinite weights are the damage that can be seen.
    A dequantized piece is checked after scaling, so a broken scale is caught as well."""
    for name, piece, scale in zip(hf_names, pieces, scales):
        if non_finite(piece):
            what = f"tensor {name}"
            if scale:
                elsewhere = f" in {located[scale]}" if located[scale] != located[name] else ""
                what += f" (dequantized with {scale}{elsewhere})"
            return (f"{located[name]}: {what} holds NaN or infinite values: the file is corrupt or "
                    f"the model itself is broken; {REDOWNLOAD}")
    return None


def _scale_name(name: str, arch: ArchitectureSpec, located: dict, tensor_slice, hf_dir) -> str | None:
    """The `_scale_inv` tensor to dequantize `name` with (None: it is read as stored), after checking
    that the weight's dtype, the config and the scale's shape agree."""
    weight = tensor_slice(name)
    dtype, shape = weight.get_dtype(), list(weight.get_shape())
    scale = name + SCALE_SUFFIX
    if arch.fp8_block is None:
        if dtype in ONE_BYTE_DTYPES:
            raise CheckpointMismatch(
                f"{hf_dir}: tensor {name} is stored as {dtype}, but config.json has no block-wise FP8 "
                f"quantization_config to dequantize it with; use the checkpoint's own config.json (or a BF16 checkpoint)"
            )
        return None
    if scale not in located:
        if dtype in ONE_BYTE_DTYPES:
            raise CheckpointMismatch(
                f"{hf_dir}: tensor {name} is stored as {dtype} but its scale {scale} is missing: the checkpoint "
                f"is incomplete; {REDOWNLOAD}"
            )
        return None  # kept in high precision (norms, embeddings, lm_head, router, biases)
    if dtype != FP8_DTYPE:
        raise CheckpointMismatch(
            f"{hf_dir}: tensor {name} has a scale {scale} but is stored as {dtype}; only float8_e4m3fn "
            f"({FP8_DTYPE}) weights are dequantized"
        )
    if len(shape) != 2:
        raise CheckpointMismatch(f"{hf_dir}: tensor {name} of shape {shape} has a scale {scale}, but block-wise "
                                 "FP8 quantizes 2-D weights only")
    want = [-(-n // b) for n, b in zip(shape, arch.fp8_block)]
    got = list(tensor_slice(scale).get_shape())
    if got != want:
        raise CheckpointMismatch(
            f"tensor {scale} has shape {got} in the checkpoint but {name} of shape {shape} in blocks of "
            f"{list(arch.fp8_block)} (quantization_config.weight_block_size) needs {want}"
        )
    return scale


def _read(name: str, index: tuple[slice, ...], scale: str | None, arch: ArchitectureSpec, tensor_slice) -> torch.Tensor:
    """This rank's slice of one HF tensor; a quantized one is dequantized to float32 from the weight's
    own rows and columns and the scales of the blocks they touch (never the whole tensor)."""
    weight = tensor_slice(name)
    if scale is None:
        return weight[index]
    shape = weight.get_shape()
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    window, blocks = [], []
    for part, size, block in zip(index, shape, arch.fp8_block):
        start, stop, step = part.indices(size)
        assert step == 1, "the importer reads contiguous slices"
        stop = max(start, stop)
        window.append(slice(start, stop))
        blocks.append(slice(start // block, -(-stop // block) if stop > start else start // block))
    return dequantize_blockwise(weight[tuple(window)], tensor_slice(scale)[tuple(blocks)], arch.fp8_block,
                                origin=(window[0].start, window[1].start))


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
    mtp = _mtp_tensors(set(located) - used, arch)
    extra = sorted(set(located) - used - ignored - set(mtp))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointMismatch(f"{hf_dir}: tensor {extra[0]}{more} is not used by {arch.architecture}")
    if mtp and (not dist.is_initialized() or dist.get_rank() == 0):
        layers = ", ".join(f"model.layers.{layer}.*" for layer in sorted(set(mtp.values())))
        print(f"skipping {len(mtp)} multi-token-prediction tensors ({layers}): not used for RL training", flush=True)


def _mtp_tensors(names, arch: ArchitectureSpec) -> dict[str, int]:
    """Name -> layer of the checkpoint's multi-token-prediction tensors (config.json's
    num_nextn_predict_layers layers after the last decoder layer); none unless the config has them."""
    found = {}
    for name in names:
        match = HF_LAYER.match(name)
        if match and arch.num_layers <= int(match.group(1)) < arch.num_layers + arch.num_mtp_layers:
            found[name] = int(match.group(1))
    return found


def _pad_rows(value: torch.Tensor, rows: int) -> torch.Tensor:
    if value.shape[0] == rows:
        return value
    padded = value.new_zeros((rows, *value.shape[1:]))
    padded[: value.shape[0]] = value
    return padded
