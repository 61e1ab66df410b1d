"""The reference policy for the KL term: a frozen copy of the starting weights, kept off the
training device and swapped into the live model only for its forward pass.

    reference = ReferenceWeights.snapshot(policy.module)     # after the warm start / init
    with reference.swapped_in(policy.module):
        outputs = policy.logprobs(batches)

Only this rank's shards are copied (host memory: one model shard per rank), so no second model
is built and no extra device memory is held between steps. The live weights are parked on the
host during the swap and copied back bit-exactly.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class ReferenceWeights:
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    @classmethod
    def snapshot(cls, module: torch.nn.Module) -> ReferenceWeights:
        return cls({name: param.detach().to("cpu", copy=True) for name, param in module.named_parameters()})

    @contextmanager
    def swapped_in(self, module: torch.nn.Module):
        parked = {}
        with torch.no_grad():
            for name, param in module.named_parameters():
                parked[name] = param.detach().to("cpu", copy=True)
                param.copy_(self.tensors[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, param in module.named_parameters():
                    param.copy_(parked[name])

    def save(self, path) -> None:
        """This rank's shards (a resumed run needs the same reference, not its own restart point)."""
        torch.save(self.tensors, path)

    @classmethod
    def load(cls, path, module: torch.nn.Module) -> ReferenceWeights:
        tensors = torch.load(path, weights_only=True)
        expected = {name: tuple(p.shape) for name, p in module.named_parameters()}
        found = {name: tuple(t.shape) for name, t in tensors.items()}
        if expected != found:
            raise ValueError(f"reference weights in {path} were saved with another parallel layout; "
                             "resume with the layout of the original run")
        return cls(tensors)
