"""The process groups of the collective weight transport, and the wire format of one bucket.

Both sides run this module: the trainer's pipeline-stage leaders and every rank of every rollout
engine (inside vLLM's workers, through our worker extension). Neither side's own
torch.distributed world can be used: the engines are not part of the trainer's world and vLLM
builds its own inside each server. So the groups here are standalone `ProcessGroup` objects on a
TCP store that trainer rank 0 hosts, one group per pipeline stage:

    group s = [leader of stage s] + [engine 0's ranks] + [engine 1's ranks] + ...
    (group rank 0 is the stage's leader; engine e's rank r is 1 + offset(e) + r)

gloo on CPU, NCCL on GPU: the same code, only the backend and the device of the buffers differ.
A bucket travels as one flat uint8 buffer (any dtype, FP8 and its float32 scales included, in
one broadcast), which the receivers cut back into tensors by the plan's metadata.
"""

from __future__ import annotations

import datetime
import json
from typing import Iterator
from dataclasses import asdict, dataclass

import torch

STORE_PREFIX = "megatron-rl-weights"


@dataclass(frozen=True)
class GroupSpec:
    """Where and how to join: everything an engine needs, sent to it as JSON."""

    host: str  # trainer rank 0's address, reachable from every engine node
    port: int  # its TCP store
    world_size: int  # 1 + every engine rank
    stages: int  # pipeline stages: one group each
    backend: str  # "gloo" | "nccl"
    timeout_s: float
    generation: int = 0  # a fresh set of groups after a re-join uses fresh store keys

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> GroupSpec:
        return cls(**json.loads(text))


def host_store(host: str, port: int, timeout_s: float):
    """The TCP store on trainer rank 0 (it must outlive every group built on it), listening on the
    address the engines reach it at, `host` (runtime/rendezvous.py): loopback when the trainer's
    rendezvous is, not every interface."""
    from megatron_rl.runtime.rendezvous import store_server

    return store_server(host, port, timeout_s=timeout_s)


def join_stage_group(spec: GroupSpec, stage: int, rank: int, store=None):
    """Join stage `stage`'s group as `rank`; blocks until all `spec.world_size` members joined."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if store is None:
        store = dist.TCPStore(spec.host, spec.port, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"{STORE_PREFIX}/{spec.generation}/stage{stage}", store)
    if spec.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, options)
    if spec.backend != "gloo":
        raise ValueError(f"weight group backend must be gloo or nccl, got {spec.backend!r}")
    return dist.ProcessGroupGloo(prefixed, rank, spec.world_size, timeout)


def broadcast(group, buffer: torch.Tensor) -> None:
    """Broadcast `buffer` in place from group rank 0 (the stage's leader)."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([buffer], options).wait()


# ---- a bucket on the wire ----------------------------------------------------------------------


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "float32", "float8_e4m3fn"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorMeta:
        return cls(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


ALIGN = 16  # every piece starts at a multiple of this, so views of any dtype are legal


def aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def pack(pieces: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One uint8 buffer holding the pieces' bytes in order, each padded to ALIGN bytes."""
    flat = [piece.detach().contiguous().reshape(-1).view(torch.uint8) for piece in pieces]
    buffer = torch.zeros(sum(aligned(piece.numel()) for piece in flat), dtype=torch.uint8, device=device)
    offset = 0
    for piece in flat:
        buffer[offset: offset + piece.numel()].copy_(piece)
        offset += aligned(piece.numel())
    return buffer


def unpack(buffer: torch.Tensor, metas: list[TensorMeta], offset: int = 0) -> list[torch.Tensor]:
    """Views into `buffer` (no copy), one per meta, laid out as `pack` wrote them from `offset`."""
    end = offset + sum(aligned(meta.nbytes) for meta in metas)
    if end != buffer.numel():
        raise ValueError(f"bucket of {buffer.numel()} bytes does not match its metadata ({end} bytes)")
    tensors = []
    for meta in metas:
        size = meta.nbytes
        tensors.append(buffer[offset: offset + size].view(getattr(torch, meta.dtype)).view(meta.shape))
        offset += aligned(size)
    return tensors


def send_bucket(group, bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> None:
    """The leader's side of one bucket: a header (metadata bytes, payload bytes), then the payload
    (the JSON metadata, then every tensor's bytes)."""
    metas = [TensorMeta.of(name, tensor) for name, tensor in bucket]
    header = json.dumps([[meta.name, meta.dtype, list(meta.shape)] for meta in metas]).encode()
    payload = pack([torch.frombuffer(bytearray(header), dtype=torch.uint8)] + [tensor for _, tensor in bucket], device)
    broadcast(group, torch.tensor([len(header), payload.numel()], dtype=torch.int64, device=device))
    broadcast(group, payload)


def send_end(group, device: torch.device) -> None:
    """A header of zeros: the stage has no more buckets."""
    broadcast(group, torch.zeros(2, dtype=torch.int64, device=device))


def receive_stage(group, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """The engine side of one stage: (name, tensor) pairs until the leader's end marker."""
    while True:
        header = torch.zeros(2, dtype=torch.int64, device=device)
        broadcast(group, header)
        meta_bytes, total = (int(value) for value in header.tolist())
        if total == 0:
            return
        payload = torch.empty(total, dtype=torch.uint8, device=device)
        broadcast(group, payload)
        metas = [TensorMeta(name, dtype, tuple(shape))
                 for name, dtype, shape in json.loads(bytes(payload[:meta_bytes].cpu().numpy()).decode())]
        yield from zip((meta.name for meta in metas), unpack(payload, metas, offset=aligned(meta_bytes)))
