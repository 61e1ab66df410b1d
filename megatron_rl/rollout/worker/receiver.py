"""The engine side of the collective weight transport, inside vLLM's workers (CPU and GPU).

Mixed into our worker extension (`worker/extension.WeightSyncWorker`), so a server's workers answer
`/collective_rpc` calls:

    weight_receiver_rank()              -> this worker's rank within its engine (the engine's
                                           world size is the number of answers)
    join_weight_group(spec_json, offset) joins every pipeline stage's group as offset + rank
    receive_weights()                   -> tensors loaded: receives stage after stage, in one reload

vLLM's own weight-transfer engines cover NCCL only, and run a second copy of the trainer-side
protocol; this one is the same code for gloo (CPU) and NCCL (GPU), and loads through the same
in-place reload as the other transports (`_reload`, which repairs what vLLM's CPU build gets wrong).
"""

from __future__ import annotations

import torch

from megatron_rl.rollout.weights.group import GroupSpec, join_stage_group, receive_stage


class CollectiveReceiverWorker:
    def weight_receiver_rank(self) -> int:
        from vllm.distributed.parallel_state import get_world_group

        return get_world_group().rank_in_group

    def join_weight_group(self, spec_json: str, rank_offset) -> int:
        spec = GroupSpec.from_json(spec_json)
        rank = int(rank_offset) + self.weight_receiver_rank()
        # Stage by stage, in order: each stage's leader joins only its own group.
        self._weight_groups = [join_stage_group(spec, stage, rank) for stage in range(spec.stages)]
        self._weight_device = self._receiver_device(spec.backend)
        return rank

    def receive_weights(self) -> int:
        groups = getattr(self, "_weight_groups", None)
        if not groups:
            raise RuntimeError("join_weight_group must be called before receive_weights")
        device = self._weight_device

        def received():
            for group in groups:
                yield from receive_stage(group, device)

        count = self._reload(received())
        if device.type == "cuda":
            torch.cuda.synchronize()
        return count

    def _receiver_device(self, backend: str) -> torch.device:
        if backend == "nccl":
            device = getattr(self, "device", None)
            return device if device is not None else torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
