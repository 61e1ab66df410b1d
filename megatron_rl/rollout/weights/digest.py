"""A cheap fingerprint of a weight push, computed the same way on both ends.

The trainer digests the tensors it sends as they pass (count, elements, float64 sum and sum of
squares); the engine's worker digests the tensors it receives, in `_reload`, and also records the
float64 sum of the parameters it serves once they are loaded. After every push the trainer asks
each engine for both (transport.verify_engines): the received digest must equal what was sent, and
the served sum must not have moved since the push. A push that lost tensors, one that another
client replaced (an open endpoint let anyone load a file of zeros), or weights changed in place
between pushes are named instead of becoming the next step's rollouts.

Sums of the same tensors in the same order with the same kernels are bit-identical; the
tolerance covers a trainer and an engine on different devices (a GPU's reduction order). One pass
over each tensor, on the device it is on, no copies, one host read at the end
(benchmarks/results/gpu_faults_h200.md measures it on a GPU).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Iterator

import torch

RELATIVE_TOLERANCE = 1e-9


@dataclass
class WeightDigest:
    tensors: int = 0
    numel: int = 0
    total: float = 0.0
    squares: float = 0.0

    def __post_init__(self):
        # Per-device running (sum, sum of squares), read once: a host read per tensor would stall
        # a GPU stream at every tensor of the push (measured: 8x one copy of the weights with it).
        self._pending: dict[torch.device, torch.Tensor] = {}

    def add(self, tensor: torch.Tensor) -> None:
        values = _summable(tensor)
        self.tensors += 1
        self.numel += tensor.numel()
        part = torch.stack([torch.sum(values, dtype=torch.float64),
                            torch.linalg.vector_norm(values, dtype=torch.float64).square()])
        running = self._pending.get(values.device)
        self._pending[values.device] = part if running is None else running + part

    def _settle(self) -> None:
        for running in self._pending.values():
            total, squares = running.tolist()
            self.total += total
            self.squares += squares
        self._pending.clear()

    def merged(self, other: WeightDigest) -> WeightDigest:
        self._settle()
        other._settle()
        return WeightDigest(self.tensors + other.tensors, self.numel + other.numel, self.total + other.total,
                            self.squares + other.squares)

    def matches(self, other: WeightDigest) -> bool:
        self._settle()
        other._settle()

        def close(a: float, b: float) -> bool:
            return math.isclose(a, b, rel_tol=RELATIVE_TOLERANCE, abs_tol=1e-6)

        return (self.tensors, self.numel) == (other.tensors, other.numel) and close(self.total, other.total) \
            and close(self.squares, other.squares)

    def to_dict(self) -> dict:
        self._settle()
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict | None) -> WeightDigest | None:
        return None if values is None else cls(**values)

    def __str__(self) -> str:
        self._settle()
        return f"{self.tensors} tensors, {self.numel} values, sum {self.total:.9g}, sum of squares {self.squares:.9g}"


def digesting(stream: Iterable[tuple[str, torch.Tensor]], digest: WeightDigest) -> Iterator[tuple[str, torch.Tensor]]:
    """`stream` unchanged, each tensor added to `digest` as it passes."""
    for name, tensor in stream:
        digest.add(tensor)
        yield name, tensor


def served_sum(parameters: Iterable[torch.Tensor]) -> float:
    """The float64 sum of the parameters an engine serves (its own layout: fused, sharded, packed)."""
    sums = [torch.sum(_summable(p.detach()), dtype=torch.float64) for p in parameters]
    return float(torch.stack(sums).sum()) if sums else 0.0


def _summable(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as the reductions take it: FP8 weights and scales (model.export_fp8) and integer
    buffers as their float32 values (exact); wider floats as they are."""
    return tensor if tensor.is_floating_point() and tensor.element_size() > 1 else tensor.to(torch.float32)
