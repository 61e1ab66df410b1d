"""The conversions between Hugging Face safetensors and torch_dist without holding the model.

Both directions build the Megatron model on the meta device (model/builder.build_model with
meta=True): every parameter's shape, dtype, tensor-parallel split and torch_dist key, and no
memory. The values then pass through one tensor (or one bucket) at a time, so a conversion's
memory is bounded by a bucket and the largest tensor, not by the model (benchmarks/scale.py
measures it up to 8B parameters on a 24 GiB machine).

HF -> torch_dist (`MetaValues`): Megatron-Core's own save is given the meta model's sharded state
dict; the writer asks for each tensor just before writing it (checkpoint/format.py:
streaming_save_strategy(values)), and MetaValues reads that parameter's slices from the
safetensors files (bridge/importer.HfWeights: the same reads, checks and fused layouts as
loading into a live model). At any layout, each rank writes its own shards.

torch_dist -> HF (`write_hf_from_torch_dist`): one process, whatever layout the checkpoint was
saved at. torch_dist stores every tensor in its global shape, so the whole (TP1, PP1, EP1) model
on the meta device names every key and chunk; a bucket of parameters at a time, exactly their
chunks are read (torch.distributed.checkpoint's reader, `_ChunkReads` planning the reads) into
tensors of their own, split into their HF pieces (bridge/layouts.py) and streamed into
safetensors files whose headers were written from the meta shapes before any value was read
(bridge/safetensors_stream.py), with each file's CRC-32 taken as it is written.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_rl.bridge.importer import non_finite
from megatron_rl.bridge.layouts import split
from megatron_rl.bridge.lora_merge import merged_weight
from megatron_rl.bridge.mappings import expand
from megatron_rl.bridge.placement import Placement, placements
from megatron_rl.bridge.safetensors_stream import SafetensorsStream, plan_files
from megatron_rl.errors import ConfigError
from megatron_rl.model.hf_config import ArchitectureSpec

class MetaValues:
    """`save_megatron_checkpoint(values=...)` for a model on the meta device: the value of a tensor
    the writer is about to write. That tensor is a parameter of the model or a view of one
    (Megatron-Core saves a gated MLP's fc1 as two halves, views of the parameter); the parameter
    is read whole with `read(placement)` and the view taken from it with the same strides and
    offset. One parameter is held at a time: the writer asks for the two halves of an fc1 one
    after the other, so the second is served from the held value. Buffers are served the same
    way: Megatron-Core creates the routers' expert bias on the CPU even under the meta device,
    as zeros, which a save that skipped non-meta tensors wrote as the checkpoint's bias."""

    def __init__(self, module, read: Callable[[Placement], torch.Tensor]):
        self._placements = {storage_key(placement.param): placement for placement in placements(module)}
        self._read = read
        self._held: tuple[int, torch.Tensor] | None = None  # (the parameter's storage key, its value)

    def __call__(self, view: torch.Tensor) -> torch.Tensor:
        key = storage_key(view)  # a CPU tensor's storage handle is as good as a meta one's
        if self._held is None or self._held[0] != key:
            self._held = None  # the previous value goes before the next one is read
            placement = self._placements.get(key)
            if placement is None:
                raise RuntimeError(f"the checkpoint writer asked for a tensor of shape {list(view.shape)} that is "
                                   "not a parameter or buffer of the model (nor a view of one)")
            value = self._read(placement)
            if value.shape != placement.param.shape:
                raise RuntimeError(f"{placement.global_name}: read {list(value.shape)}, the model has "
                                   f"{list(placement.param.shape)}")
            # The views are taken with the meta parameter's strides: a contiguous parameter's
            # (a column slice read from safetensors, a row-parallel shard, is not contiguous).
            self._held = (key, value.contiguous())
        return view_like(self._held[1], view)


def view_like(value: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """The view of `value` that `view` is of its (meta) parameter: same shape, strides and offset
    from the parameter's start. as_strided's offset counts from the start of the storage, and
    `value` may begin inside a larger one (safetensors hands out a TP shard's rows as a slice of
    the whole tensor): taken from the storage's start, rank 1 of a TP2 DeepSeek-V3 wrote rank 0's
    rows of every plain column-parallel weight."""
    return value.as_strided(view.size(), view.stride(), value.storage_offset() + view.storage_offset())


def storage_key(tensor: torch.Tensor) -> int:
    """Which parameter a meta tensor is, or is a view of. A meta tensor has no data pointer, but
    it has a storage, shared by its views and detached copies (the checkpoint writer hands out
    detached views, whose `_base` is unset): the storage object's handle tells them apart."""
    return tensor.untyped_storage()._cdata


@dataclasses.dataclass
class _Parameter:
    placement: Placement
    hf_names: tuple[str, ...]
    layout: str
    sharded: list  # the parameter's ShardedTensors (its torch_dist keys; two for a gated fc1)

    @property
    def bytes(self) -> int:
        return self.placement.param.numel() * self.placement.param.element_size()


def write_hf_from_torch_dist(module, arch: ArchitectureSpec, weights: Path, index, staging: Path, *, precision: str,
                             file_bytes: int = 2 << 30, bucket_bytes: int = 512 << 20,
                             adapters: dict | None = None, held: tuple[Path, object] | None = None) -> dict[str, dict]:
    """The safetensors files and model.safetensors.index.json of the torch_dist checkpoint in
    `weights`, written into `staging`. `module`: the whole model (TP1, PP1, EP1) on the meta
    device, built at the checkpoint's precision and padded vocabulary, with Megatron's parallel
    state still up. A bf16 checkpoint's fp32 parameters (Megatron-Core's local spec keeps RMSNorm
    weights in fp32) are written in bf16 as `save_pretrained` writes them; buffers (the routers'
    fp32 expert bias) keep their dtype. `index`: the directory's torch_dist index (.metadata), as
    the caller read it (checkpoint/unpickling.py: torch's own reader unpickles it in full, so it is
    never used here). Returns each written file's size and CRC-32.
    `adapters`: a LoRA run's adapters (read_adapters; the model built with its model.lora), each
    merged into its weight as the run's own export does (bridge/lora_merge.py); without them a
    checkpoint holding adapters is refused.
    `held`: (weights, index) of the LoRA checkpoint whose referenced base `weights` is: every
    parameter or buffer it holds itself (beside its adapters: the routers' expert bias, which
    model.moe_router_bias_update_rate moves during training) is read from it, not from the base,
    as a resume loads it over the base; the base gives only what the checkpoint leaves out."""
    if adapters is None:
        refuse_adapters(weights, index)
    parameters = _parameters(module, arch)
    planned = []
    for item in parameters:
        for name, piece in zip(item.hf_names, _hf_pieces(item, item.placement.param, arch)):
            planned.append((name, _output_dtype(item.placement, precision), tuple(piece.shape)))
    files = plan_files(planned, file_bytes)
    reader = _IndexReadOnce(str(weights), index)
    own = _IndexReadOnce(str(held[0]), held[1]) if held is not None else None
    with SafetensorsStream(staging, files) as out:
        for bucket in _buckets(parameters, bucket_bytes):
            values = _load_from(bucket, reader, own, held[1] if held is not None else None)
            for item in bucket:
                value = merged_weight(values.pop(0), (adapters or {}).get(item.placement.global_name))
                for name, piece in zip(item.hf_names, _hf_pieces(item, value, arch)):
                    out.write(name, piece.to(_output_dtype(item.placement, precision)))
                del value
            del values
    (staging / "model.safetensors.index.json").write_text(json.dumps(out.index(), indent=2) + "\n")
    return out.checksums


def _load_from(bucket: list[_Parameter], reader, own, own_index) -> list[torch.Tensor]:
    """_load, each parameter whose torch_dist keys `own_index` holds (all of them) read through
    `own` instead of `reader`, in `bucket`'s order."""
    if own is None:
        return _load(bucket, reader)
    mine = [all(s.key in own_index.state_dict_metadata for s in item.sharded) for item in bucket]
    theirs = iter(_load([item for item, m in zip(bucket, mine) if m], own) if any(mine) else [])
    rest = iter(_load([item for item, m in zip(bucket, mine) if not m], reader) if not all(mine) else [])
    return [next(theirs) if m else next(rest) for m in mine]


def refuse_adapters(weights: Path, index) -> None:
    """A checkpoint of a LoRA run (model.lora) holds the base weights and the adapters beside them:
    converting it here would write the base model without the adapters, so it is refused by name."""
    adapters = sorted(key for key in index.state_dict_metadata if ".lora_A" in key or ".lora_B" in key)
    if adapters:
        raise ConfigError(f"{weights}: the checkpoint holds LoRA adapters ({adapters[0]} and {len(adapters) - 1} "
                          "more); converting it alone would write the base model without them. Pass --merge-lora "
                          "for the merged model (W + (alpha / rank) B A), or use `megatron-rl convert "
                          "megatron-to-peft` for the adapters as a PEFT directory")


def read_adapters(module, weights: Path, index) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """A LoRA run's adapters from its torch_dist checkpoint, whole: {global weight name: (A, B,
    alpha / rank)}. `module`: the whole model (TP1, PP1, EP1) on the meta device built with the
    run's model.lora, so its adapters name their torch_dist keys (saved at any layout); they are
    small (rank x (in + out) each), read in one pass."""
    sharded = _sharded_by_storage(module)
    items, owners = [], []
    for placement in placements(module):
        if placement.adapter is None:
            continue
        a, b, scale = placement.adapter
        owners.append((placement.global_name, scale))
        for tensor in (a, b):
            chunks = sharded.pop(storage_key(tensor), [])
            if not chunks:
                raise RuntimeError(f"the adapter of {placement.global_name} has no torch_dist key in the model")
            items.append(_Parameter(dataclasses.replace(placement, param=tensor, adapter=None), (), "plain", chunks))
    values = _load(items, _IndexReadOnce(str(weights), index)) if items else []
    return {name: (values[2 * i], values[2 * i + 1], scale) for i, (name, scale) in enumerate(owners)}


def _sharded_by_storage(module) -> dict[int, list]:
    """{storage key: the ShardedTensors (torch_dist keys) of that parameter or buffer}."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sharded_state_dict = module.sharded_state_dict()
    apply_factories(sharded_state_dict)
    sharded: dict[int, list] = {}
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensor):  # ShardedObjects (layers' _extra_state) hold no weights
            sharded.setdefault(storage_key(value.data), []).append(value)
    return sharded


def _parameters(module, arch: ArchitectureSpec) -> list[_Parameter]:
    sharded = _sharded_by_storage(module)
    for placement in placements(module):  # the adapters are read apart (read_adapters)
        for tensor in placement.adapter[:2] if placement.adapter is not None else ():
            sharded.pop(storage_key(tensor), None)
    table = {name: (hf, layout) for name, hf, layout in expand(arch)}
    out = []
    for placement in placements(module):
        if placement.global_name not in table:  # (a tied model at PP1 has no output layer of its own)
            raise ConfigError(f"Megatron parameter {placement.global_name} has no HF mapping for {arch.architecture}")
        hf_names, layout = table[placement.global_name]
        out.append(_Parameter(placement, hf_names, layout, sharded.pop(storage_key(placement.param), [])))
        if not out[-1].sharded:
            raise RuntimeError(f"parameter {placement.global_name} has no torch_dist key in the model's state dict")
    if sharded:
        keys = sorted(item.key for items in sharded.values() for item in items)
        raise RuntimeError(f"torch_dist keys of no parameter or buffer of the model: {keys[:3]}")
    return out


def _hf_pieces(item: _Parameter, value: torch.Tensor, arch: ArchitectureSpec) -> list[torch.Tensor]:
    pieces = split(item.layout, value, arch)
    return [piece[: arch.vocab_size] for piece in pieces] if item.layout == "vocab" else pieces


def _output_dtype(placement: Placement, precision: str) -> torch.dtype:
    if precision == "bf16" and isinstance(placement.param, torch.nn.Parameter):
        return torch.bfloat16
    return placement.param.dtype


def _buckets(parameters: list[_Parameter], bucket_bytes: int):
    bucket, size = [], 0
    for item in parameters:
        if bucket and size + item.bytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += item.bytes
    if bucket:
        yield bucket


def _load(bucket: list[_Parameter], reader) -> list[torch.Tensor]:
    """The values of `bucket`'s parameters, read from torch_dist into tensors of their own. Each of
    a parameter's ShardedTensors names a chunk of a global tensor of the checkpoint (its key, its
    offset, its shape); the chunk is read into the view of the new tensor that the ShardedTensor's
    meta data is of the meta parameter, so the two halves of an fc1 land in place. Only these
    chunks are read, whatever else the same global tensor holds (a layer's experts are one
    tensor, all of DeepSeek-V3's 256 of them 15 GB): Megatron-Core's loader reads every chunk of
    a global tensor at once, which would bound the memory by the largest such tensor instead."""
    values, chunks = [], []
    for item in bucket:
        meta = item.placement.param
        value = torch.empty(meta.shape, dtype=meta.dtype)
        for sharded in item.sharded:
            target = view_like(value, sharded.data)
            # The chunk's shape has the prepended axes (layer, expert) of the global tensor.
            chunks.append((sharded, target.view((1,) * sharded.prepend_axis_num + tuple(sharded.local_shape))))
        values.append(value)
    try:
        with torch.no_grad():
            dcp.load({}, storage_reader=reader, planner=_ChunkReads(chunks), no_dist=True)
    except (Exception, CheckpointException) as exc:  # torch's CheckpointException is a BaseException
        # The planner's own verdicts (a missing or mis-shaped tensor) come back wrapped by torch.
        inner = failure_to_reraise(exc) or (exc if isinstance(exc, ConfigError) else None)
        if isinstance(inner, KeyboardInterrupt):
            raise inner from None
        if inner is not None:
            raise TorchDistUnreadable(str(inner)) from None
        raise TorchDistUnreadable(str(exc)) from exc  # the caller says which file, and what to do
    del chunks
    for item, value in zip(bucket, values):
        if non_finite(value):
            # torch_dist stores no checksum: NaN/infinite weights are the damage that can be seen.
            raise TorchDistUnreadable(f"tensor {item.sharded[0].key} holds NaN or infinite values: a file is "
                                      "corrupt or the model diverged")
    return values


def failure_to_reraise(exc: BaseException) -> BaseException | None:
    """Of the errors torch's checkpoint code gathers from every rank into one CheckpointException
    (`failures`: rank -> (error, traceback)), the one that must unwind as itself: a stop signal
    (KeyboardInterrupt, tools/ranks.Interrupted) first, else a ConfigError; None otherwise."""
    errors = [error for error, _ in (getattr(exc, "failures", None) or {}).values()]
    return next((e for e in errors if isinstance(e, KeyboardInterrupt)), None) or next(
        (e for e in errors if isinstance(e, ConfigError)), None)


class TorchDistUnreadable(Exception):
    """The torch_dist files could not be read (the loader's exception is the __cause__), do not
    match the model, or hold NaN/infinite weights; the caller names the checkpoint and the remedy."""


class _ChunkReads(DefaultLoadPlanner):
    """torch.distributed.checkpoint's load planner for exactly the given chunks: (a Megatron
    ShardedTensor naming the chunk, the tensor to read it into). Each must be covered whole by
    the checkpoint's stored chunks, of a global tensor of the same shape."""

    def __init__(self, chunks):
        super().__init__()
        self.chunks = chunks
        self.targets: dict[tuple[str, int], torch.Tensor] = {}

    def create_local_plan(self) -> LoadPlan:
        wanted: dict[str, list] = {}
        for sharded, target in self.chunks:
            wanted.setdefault(sharded.key, []).append((sharded, target))
        items = []
        for key, pieces in wanted.items():
            stored = self.metadata.state_dict_metadata.get(key)
            if not isinstance(stored, TensorStorageMetadata):
                raise ConfigError(f"the checkpoint holds no tensor {key}: it does not match its hf_config/")
            if tuple(stored.size) != tuple(pieces[0][0].global_shape):
                raise ConfigError(f"tensor {key} has shape {list(stored.size)} in the checkpoint, the model "
                                  f"described by its hf_config/ needs {list(pieces[0][0].global_shape)}")
            local = [ChunkStorageMetadata(offsets=torch.Size(sharded.global_offset), sizes=target.shape)
                     for sharded, target in pieces]
            reads = create_read_items_for_chunk_list(key, stored, local)
            covered = [0] * len(pieces)
            for read in reads:
                covered[read.dest_index.index] += math.prod(read.lengths)
            for index, ((sharded, target), count) in enumerate(zip(pieces, covered)):
                if count != target.numel():
                    raise ConfigError(f"the checkpoint holds {count} of the {target.numel()} values of tensor "
                                      f"{key} at offset {list(sharded.global_offset)}: it is incomplete")
                self.targets[(key, index)] = target  # the read items name it by (key, index in `local`)
            items += reads
        return LoadPlan(items)

    def resolve_tensor(self, read_item):
        target = self.targets[(read_item.dest_index.fqn, read_item.dest_index.index)]
        return narrow_tensor_by_index(target, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item, tensor) -> None:
        pass  # read into the target's own memory (resolve_tensor's view of it)


class _IndexReadOnce(FileSystemReader):
    """A reader of a torch_dist directory that uses the index its caller read (once, safely), not
    torch's reading of it at every bucket's load."""

    def __init__(self, path: str, index):
        super().__init__(path)
        self._parsed = index
        if getattr(self._parsed, "storage_meta", None) is None:
            self._parsed.storage_meta = StorageMeta()

    def read_metadata(self):
        self._parsed.storage_meta.load_id = self.load_id  # as torch's read_metadata does
        return self._parsed
