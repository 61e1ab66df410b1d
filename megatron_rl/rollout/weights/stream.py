"""Trainer side of weight sync: the HF-named model as a stream, on the ranks that send it.

    stream = hf_weight_stream(policy.module, policy.arch, destination=transport.destination)
    transport.push(stream)            # every rank (rollout/weights/transport.py)

Every trainer rank must consume the stream, tensors or not: producing it takes collectives (TP and
EP gathers inside each pipeline stage). `destination="all"` gives every rank the full tensors (a
colocated engine sharded across all ranks; with pipeline parallelism one broadcast per bucket from
each stage's leader); `"main"` gives the whole model to global rank 0 only (the files transport);
`"leaders"` gives each pipeline stage's leader its own stage's tensors and moves nothing between
stages (the collective transport, whose leaders send to the engines directly). Other ranks'
streams yield nothing.

Memory: one bucket (bucket_bytes) plus the tensor being assembled, per rank. The bucket is
dropped as soon as its tensors were handed on.
"""

from __future__ import annotations

import functools
from typing import Iterator, Literal

import torch
import torch.distributed as dist

from megatron_rl.bridge import export_hf_weights
from megatron_rl.bridge.export import is_stage_leader
from megatron_rl.model.hf_config import ArchitectureSpec

Destination = Literal["all", "main", "leaders"]


def hf_weight_stream(
    module, arch: ArchitectureSpec, *, destination: Destination = "all", bucket_bytes: int = 512 << 20,
    dtype: torch.dtype | None = None, merge_adapters: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`merge_adapters=False`: a LoRA model's base weights W without its adapters (bridge/export.py)."""
    from megatron.core import parallel_state as ps

    export = functools.partial(export_hf_weights, merge_adapters=merge_adapters)

    pp = ps.get_pipeline_model_parallel_world_size()
    if destination == "leaders":
        for bucket in export(module, arch, bucket_bytes=bucket_bytes, dtype=dtype, every_rank=False):
            yield from bucket
            del bucket  # not held while the next bucket is assembled (one bucket at a time)
        return
    if pp == 1:
        # Stage 0's leader is global rank 0, and every rank holds the whole model's layers.
        every_rank = destination == "all"
        for bucket in export(module, arch, bucket_bytes=bucket_bytes, dtype=dtype, every_rank=every_rank):
            yield from bucket
            del bucket
        return
    yield from _across_stages(export, module, arch, destination, bucket_bytes, dtype,
                              ps.get_pipeline_model_parallel_rank(), pp)


def drain(stream: Iterator) -> None:
    """Take part in producing a stream whose tensors this rank does not need."""
    for _ in stream:
        pass


def _across_stages(export, module, arch, destination, bucket_bytes, dtype, my_stage: int, pp: int):
    """Stage by stage, each bucket is broadcast over the world from its stage's leader.

    All ranks of the producing stage run the export with `every_rank=True`, so they reach each
    bucket together and can join the broadcast in step with everyone else."""
    leaders = _stage_leaders(pp)
    keep = destination == "all" or dist.get_rank() == 0
    for stage in range(pp):
        source = leaders[stage]
        if stage == my_stage:
            for bucket in export(module, arch, bucket_bytes=bucket_bytes, dtype=dtype, every_rank=True):
                meta = [(name, tensor.shape, tensor.dtype) for name, tensor in bucket]
                _broadcast_object(meta, source)
                for name, tensor in bucket:
                    received = tensor.contiguous() if dist.get_rank() == source else torch.empty_like(tensor)
                    dist.broadcast(received, src=source)
                    if keep:
                        yield name, tensor
                del bucket
            _broadcast_object(None, source)
            continue
        while (meta := _broadcast_object(None, source)) is not None:
            for name, shape, tensor_dtype in meta:
                tensor = torch.empty(shape, dtype=tensor_dtype, device=_device())
                dist.broadcast(tensor, src=source)
                if keep:
                    yield name, tensor


def _stage_leaders(pp: int) -> list[int]:
    from megatron.core import parallel_state as ps

    mine = (ps.get_pipeline_model_parallel_rank(), dist.get_rank(), is_stage_leader())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    leaders = {stage: rank for stage, rank, leader in everyone if leader}
    return [leaders[stage] for stage in range(pp)]


def _broadcast_object(value, source: int):
    holder = [value if dist.get_rank() == source else None]
    dist.broadcast_object_list(holder, src=source)
    return holder[0]


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class ByteCount:
    """A weight stream passed through unchanged, counting the bytes of its tensors (`bytes`)."""

    def __init__(self, stream: Iterator[tuple[str, torch.Tensor]]):
        self.stream, self.bytes = stream, 0

    def __iter__(self):
        for name, tensor in self.stream:
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor


def pushed_bytes(counted: int, destination: Destination) -> int:
    """The bytes of one push of the model, on the driver, from every rank's count of its own stream:
    with destination "all" or "main" the driver's stream holds the whole model; with "leaders"
    each stage's leader holds its stage (summed over the world, one scalar)."""
    if destination != "leaders" or not dist.is_initialized():
        return counted
    total = torch.tensor([counted], dtype=torch.int64, device=_device())
    dist.all_reduce(total)
    return int(total.item())
