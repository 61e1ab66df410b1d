"""Per-sample sums under context parallelism and masked extrema, shared by the loss modules (private).

Under context parallelism (CP) each rank holds a slice of every sample's tokens, so a per-sample
sum (GSPO's log-ratio, a sequence importance weight, DeepSeek-V3.2's sequence KL) is the sum of
the local partial sums over the CP group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["cp_world", "sum_over_cp", "masked_max", "masked_min"]


def cp_world(cp_group) -> int:
    return dist.get_world_size(cp_group) if cp_group is not None else 1


class _AllReduceSum(torch.autograd.Function):
    """Differentiable SUM all-reduce: the backward of a sum over ranks is again a sum over ranks
    (every rank's loss depends on every rank's tokens through the per-sample sum)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_over_cp(x: torch.Tensor, cp_group, differentiable: bool) -> torch.Tensor:
    """Sum per-sample partial sums over context-parallel ranks (each holds a slice of the sample)."""
    if cp_world(cp_group) <= 1:
        return x
    if differentiable:
        return _AllReduceSum.apply(x, cp_group)
    x = x.clone()
    dist.all_reduce(x, group=cp_group)
    return x


def masked_max(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:
        return torch.tensor(float("-inf"), dtype=torch.float64, device=x.device)
    return x.detach().double().masked_fill(~valid, float("-inf")).max()


def masked_min(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:
        return torch.tensor(float("inf"), dtype=torch.float64, device=x.device)
    return x.detach().double().masked_fill(~valid, float("inf")).min()
