"""LoRA adapters merged into their weights on export: W + (alpha / rank) B A.

Each rank merges its own shard, before any gather: the adapter is sharded the way its weight is
(model/lora.py), so for a column-parallel weight W_r = W[rows_r] and B_r = B[rows_r] with A whole,
and for a row-parallel one W_r = W[:, cols_r] and A_r = A[:, cols_r] with B whole; in both cases
B_r A_r is exactly the shard of B A that W_r is of W. Experts' adapters are per expert, so each
expert's merge is local too. The merged shard then goes through the export's gathers and fused
layout splits like the weight itself, and no transport or writer needs to know about LoRA.
"""

from __future__ import annotations

import math

import torch

from megatron_rl.errors import ConfigError


def merged_weight(weight: torch.Tensor, adapter: tuple[torch.Tensor, torch.Tensor, float] | None,
                  name: str | None = None) -> torch.Tensor:
    """`weight` (this rank's shard) with its adapter (A, B, scale) merged in, in the weight's dtype
    (the product and the sum taken in float32 at least, rounded once). A merge that is not finite
    where the weight was is refused naming model.lora.alpha: sent on, the engines would serve
    infinities and the push's digest check would blame someone else for them."""
    if adapter is None:
        return weight
    a, b, scale = adapter
    compute = torch.promote_types(weight.dtype, torch.float32)
    delta = b.detach().to(compute) @ a.detach().to(compute)
    merged = (weight.to(compute) + scale * delta).to(weight.dtype)
    if not bool(torch.isfinite(merged).all()) and bool(torch.isfinite(weight).all()):
        raise ConfigError(non_finite_merge(name, weight, delta, scale))
    return merged


def non_finite_merge(name: str | None, weight: torch.Tensor, delta: torch.Tensor, scale: float) -> str:
    largest = float(delta.abs().max()) if delta.numel() else 0.0
    what = f"{name} ({tuple(weight.shape)}, {weight.dtype})" if name else f"a {tuple(weight.shape)} {weight.dtype} weight"
    overflows = f"|B A| up to {largest:.3g}" if math.isfinite(largest) else "B A itself overflowing"
    return (f"merging the LoRA adapter into {what} gives non-finite values: the merged weight is W + (alpha / rank = "
            f"{scale:.3g}) x B A, with {overflows}. model.lora.alpha is too large for model.lora.rank (PEFT's usual "
            f"alpha is rank to 2 x rank): lower it")
