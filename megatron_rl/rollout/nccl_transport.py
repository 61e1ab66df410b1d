"""GPU weight transport: NCCL broadcast from trainer rank 0 into vLLM servers' workers.

Written to vLLM's documented weight-transfer API (`vllm.distributed.weight_transfer`): the server
runs with `--weight-transfer-config '{"backend": "nccl"}'`; trainer rank 0 and every engine worker
join one NCCL group over a TCP rendezvous; per push the trainer declares the metadata, the server's
`/update_weights` receives while rank 0 broadcasts, and `/finish_weight_update` finalizes the
layer-wise reload. The bridge's export is the `WeightSource`.

UNTESTED LIVE: this needs CUDA GPUs and the CUDA build of vLLM, which the CPU development machines
and CI do not have. The CPU paths (same-process stream, safetensors files) are what the test suite
checks against the trainer's own logprobs. Verify this path on a GPU before relying on it.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from megatron_rl.rollout.weight_sync import hf_weight_stream


def bridge_weight_source(module, arch, *, bucket_bytes: int, dtype: torch.dtype | None):
    """The bridge export as vLLM's `WeightSource`: metadata computed once (one extra export at
    start-up; shapes never change afterwards), a fresh export per iteration. Defined inside a
    function so that importing this module does not need vLLM."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    def stream():
        return hf_weight_stream(module, arch, destination="main", bucket_bytes=bucket_bytes, dtype=dtype)

    class BridgeWeightSource(WeightSource):
        def __init__(self):
            self._metadata = None

        def metadata(self):
            if self._metadata is None:
                local = [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in stream()]
                holder = [local if dist.get_rank() == 0 else None]
                dist.broadcast_object_list(holder, src=0)
                self._metadata = [ParamMeta(name, dtype_, shape) for name, dtype_, shape in holder[0]]
            return self._metadata

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            # Only rank 0 receives tensors; the other ranks take part in the export's collectives
            # and then yield placeholders, so the engine's per-name order check stays aligned.
            yield from stream()
            if dist.get_rank() != 0:
                for meta in self.metadata():
                    yield meta.name, None

    return BridgeWeightSource()


class NcclWeightTransport:
    """One per trainer: connects rank 0 to a server's workers and sends a full push on request."""

    def __init__(self, base_url: str, module, arch, *, master_address: str, master_port: int,
                 engine_world_size: int, bucket_bytes: int, dtype: torch.dtype | None, timeout_s: float):
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )

        source = bridge_weight_source(module, arch, bucket_bytes=bucket_bytes, dtype=dtype)
        init = NCCLTrainerInitInfo(master_address=master_address, master_port=master_port,
                                   world_size=1 + engine_world_size, rank=dist.get_rank())
        client = HTTPVLLMWeightSyncClient(base_url, timeout=timeout_s)
        self._engine = NCCLTrainerWeightTransferEngine.trainer_init(init, client=client, source=source)
        self._source = source

    def push(self) -> int:
        self._engine.send_weights()
        return len(self._source.metadata())

    def shutdown(self) -> None:
        self._engine.shutdown()
