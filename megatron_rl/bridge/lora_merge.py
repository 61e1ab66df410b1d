"""LoRA adapters merged into their weights on export: W + (alpha / rank) B A.

Each rank merges its own shard, before any gather: the adapter is sharded the way its weight is
(model/lora.py), so for a column-parallel weight W_r = W[rows_r] and B_r = B[rows_r] with A whole,
and for a row-parallel one W_r = W[:, cols_r] and A_r = A[:, cols_r] with B whole; in both cases
B_r A_r is exactly the shard of B A that W_r is of W. Experts' adapters are per expert, so each
expert's merge is local too. The merged shard then goes through the export's gathers and fused
layout splits like the weight itself, and no transport or writer needs to know about LoRA.
"""

from __future__ import annotations

import torch


def merged_weight(weight: torch.Tensor, adapter: tuple[torch.Tensor, torch.Tensor, float] | None) -> torch.Tensor:
    """`weight` (this rank's shard) with its adapter (A, B, scale) merged in, in the weight's dtype
    (the product and the sum taken in float32 at least, rounded once)."""
    if adapter is None:
        return weight
    a, b, scale = adapter
    compute = torch.promote_types(weight.dtype, torch.float32)
    delta = b.detach().to(compute) @ a.detach().to(compute)
    return (weight.to(compute) + scale * delta).to(weight.dtype)
