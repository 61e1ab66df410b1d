"""Export HF-named tensors from a live, sharded Megatron model.

    for bucket in export_hf_weights(module, arch, bucket_bytes=512 << 20):
        for hf_name, tensor in bucket: ...

Every rank must iterate the generator (it takes part in the gathers), but only each pipeline
stage's leader (the stage's rank with TP, DP, EP and expert-TP rank 0) receives tensors; the
others get no buckets. With `every_rank=True` every rank of the stage receives the same buckets
at the same points (the gathers leave full tensors everywhere anyway), which is what a rollout
engine sharded across the trainer's ranks needs. Stages work independently (no cross-stage traffic), so each stage's
leader yields exactly the names of the layers it holds: `owned_hf_names` lists them without
communication, so weight sync knows which rank sends what.

A weight carrying a LoRA adapter (model/lora.py) is exported merged, W + (alpha / rank) B A, each
rank merging its own shard before the gathers (bridge/lora_merge.py): every consumer (the HF
export, every weight transport, the FP8 rollout stream) gets the merged model unchanged.
`merge_adapters=False` exports the base weights W alone (the adapter-only push sends them once).

Memory bound (extra, per rank): the full tensor being assembled (TP shards gathered, and for
expert weights one copy per EP rank) plus, on a leader, the pending bucket (<= bucket_bytes,
or one tensor if a single tensor is larger). Buckets are handed out and dropped, never kept.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from megatron_rl.bridge.fp8_export import SCALE_SUFFIX, quantized_names
from megatron_rl.bridge.layouts import split
from megatron_rl.bridge.lora_merge import merged_weight
from megatron_rl.bridge.mappings import expand
from megatron_rl.bridge.placement import Placement, placements
from megatron_rl.model.hf_config import ArchitectureSpec

Bucket = list[tuple[str, torch.Tensor]]


def is_stage_leader() -> bool:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0


def export_hf_weights(
    module, arch: ArchitectureSpec, *, bucket_bytes: int = 512 << 20, dtype: torch.dtype | None = None,
    every_rank: bool = False, merge_adapters: bool = True,
) -> Iterator[Bucket]:
    receives = every_rank or is_stage_leader()
    yield from buckets(_export_tensors(module, arch, dtype, receives, merge_adapters), bucket_bytes)


def buckets(weights: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """A (name, tensor) stream in lists of at least bucket_bytes (the last one may be smaller), so
    producer and consumer each hold about one bucket. Weight transports bucket with this too."""
    bucket: Bucket = []
    size = 0
    for name, tensor in weights:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _export_tensors(module, arch: ArchitectureSpec, dtype, receives: bool,
                    merge_adapters: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor of this rank's stage; all ranks run the gathers, only receivers get tensors."""
    table = {name: (hf, layout) for name, hf, layout in expand(arch)}
    for placement in placements(module):
        if placement.global_name not in table:
            if arch.tie_word_embeddings and placement.global_name == "output_layer.weight":
                continue  # the tied copy on the last stage; the embedding is exported instead
            raise KeyError(f"Megatron parameter {placement.global_name} has no HF mapping for {arch.architecture}")
        for hf_name, tensor in _assemble(placement, table, arch, merge_adapters):
            if receives:
                yield hf_name, tensor if dtype is None else tensor.to(dtype)


def owned_hf_names(module, arch: ArchitectureSpec, fp8: bool = False) -> list[str]:
    """The HF names this rank's export yields (empty unless it leads its pipeline stage).

    `fp8`: the names of an FP8 export (quantize_fp8_blockwise), with each scale after its weight.
    """
    if not is_stage_leader():
        return []
    if fp8:
        quantized = quantized_names(arch)
        plain = owned_hf_names(module, arch)
        return [n for name in plain for n in ((name, name + SCALE_SUFFIX) if name in quantized else (name,))]
    table = {name: hf for name, hf, _ in expand(arch)}
    names = []
    for placement in placements(module):
        if placement.global_name not in table:
            continue
        if placement.is_expert:
            for expert in _experts_of(placement, arch):
                names.extend(table[_with_expert(placement.global_name, expert)])
        else:
            names.extend(table[placement.global_name])
    return names


def _assemble(placement: Placement, table, arch: ArchitectureSpec,
              merge_adapters: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    hf_names, layout = table[placement.global_name]
    tensor = merged_weight(_high_precision(placement.param.detach()), placement.adapter if merge_adapters else None,
                           placement.global_name)
    shards = _all_gather(tensor, placement.tp_group) if placement.tp_dim is not None else [tensor]
    dim = placement.tp_dim or 0
    per_shard = [split(layout, shard, arch) for shard in shards]
    pieces = [torch.cat([s[i] for s in per_shard], dim=dim) if len(per_shard) > 1 else per_shard[0][i]
              for i in range(len(hf_names))]
    if layout == "vocab":
        pieces = [p[: arch.vocab_size] for p in pieces]
    if not placement.is_expert or placement.ep_group.size() == 1:
        yield from zip(hf_names, (p.contiguous() for p in pieces))
        return
    # Expert weights: rank r of the EP group holds the same local expert slot for its own experts.
    gathered = [_all_gather(p.contiguous(), placement.ep_group) for p in pieces]
    for rank, expert in enumerate(_experts_of(placement, arch)):
        names = table[_with_expert(placement.global_name, expert)][0]
        yield from zip(names, (g[rank] for g in gathered))


def _experts_of(placement: Placement, arch: ArchitectureSpec) -> list[int]:
    """Global expert ids held in this slot across the EP group (Megatron assigns them in blocks)."""
    ep_size = placement.ep_group.size()
    per_rank = arch.num_experts // ep_size
    return [rank * per_rank + placement.local_expert for rank in range(ep_size)]


def _with_expert(global_name: str, expert: int) -> str:
    head, _, tail = global_name.partition(".mlp.experts.local_experts.")
    return f"{head}.mlp.experts.local_experts.{expert}.{tail.split('.', 1)[1]}"


def _high_precision(tensor: torch.Tensor) -> torch.Tensor:
    """FP8 weights (model.fp8_param) are TE quantized-tensor subclasses: export their values."""
    if type(tensor) is not torch.Tensor and hasattr(tensor, "dequantize"):
        return tensor.dequantize()
    return tensor


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out
