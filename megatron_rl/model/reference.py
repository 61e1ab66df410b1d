"""The reference policy for the KL term: a frozen copy of the starting weights, kept off the
training device and swapped into the live model only for its forward pass.

    reference = ReferenceWeights.snapshot(policy.module)     # after the warm start / init
    with reference.swapped_in(policy.module):
        outputs = policy.logprobs(batches)

Only this rank's shards are copied (host memory: one model shard per rank), so no second model
is built and no extra device memory is held between steps. The live weights are parked on the
host during the swap and copied back bit-exactly. The routers' expert bias is part of the copy
(model/state.py): aux-loss-free balancing moves it during training, and the reference must route
as the starting model did. Frozen parameters (the base under model.lora) are the starting
model's for the whole run, so they are not copied. Checkpoints store the tensors sharded like the weights
(checkpoint/manager.py), so a run resumed at another layout keeps the same reference.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from megatron_rl.model.state import trained_state


class ReferenceWeights:
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    @classmethod
    def snapshot(cls, module: torch.nn.Module) -> ReferenceWeights:
        return cls({name: tensor.detach().to("cpu", copy=True) for name, tensor in trained_state(module)})

    @contextmanager
    def swapped_in(self, module: torch.nn.Module):
        parked = {}
        with torch.no_grad():
            for name, tensor in trained_state(module):
                parked[name] = tensor.detach().to("cpu", copy=True)
                tensor.copy_(self.tensors[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, tensor in trained_state(module):
                    tensor.copy_(parked[name])
