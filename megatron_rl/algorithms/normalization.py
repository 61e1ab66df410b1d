"""Step-level normalizers: counts over the WHOLE optimizer step, communicated once.

The rule (the bugs it prevents are listed in docs/algorithms.md): every reduction in the loss
divides by a count taken over the whole optimizer-step batch, i.e. all micro-batches on all
data-parallel and context-parallel ranks. Dividing per micro-batch makes the gradient depend on
how the batch was split (token-mean by micro-batch tokens is the classic bug); forgetting the DP
all-reduce makes it depend on the DP size; counting every CP rank's tokens as whole sequences
over- or undercounts by a factor of CP.

The policy's training step sums micro-batch gradients over micro-batches and DP ranks without
any further scaling, so ``policy_loss`` must return the micro-batch's share of the step loss:
``compute_step_normalizer`` is called once per step, before the forward/backward passes, on the
masks of every local micro-batch, and its result is passed to every ``policy_loss`` call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_rl.algorithms._checks import check_mask, finite_number
# Aggregation modes (verl's loss_agg_mode names); aggregation.py turns each into token weights.
from megatron_rl.algorithms.names import LOSS_AGG_MODES

__all__ = ["LOSS_AGG_MODES", "StepNormalizer", "compute_step_normalizer", "sequence_lengths"]



@dataclass(frozen=True)
class StepNormalizer:
    """Counts of one optimizer step (all micro-batches, all DP and CP ranks).

    Attributes:
        loss_agg_mode: the aggregation mode these counts are for (checked by ``policy_loss``).
        num_tokens: valid (loss-mask) tokens in the step.
        num_sequences: samples with at least one valid token. Fully masked rows (padding
            samples, truncated responses masked out by ``mask_truncated``) do not count.
        max_length: the longest sample's valid length in the step.
        l_norm: Dr. GRPO's constant length normalizer: the value given, else ``max_length``.
    """

    loss_agg_mode: str
    num_tokens: float
    num_sequences: float
    max_length: float
    l_norm: float

    def __post_init__(self):
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {self.loss_agg_mode!r}")
        for name in ("num_tokens", "num_sequences", "max_length"):
            finite_number(getattr(self, name), name, low=0.0)
        finite_number(self.l_norm, "l_norm", low=0.0, low_open=True)
        if self.num_sequences > self.num_tokens:
            raise ValueError(f"num_sequences={self.num_sequences} cannot exceed num_tokens={self.num_tokens}")


def _world(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def sequence_lengths(mask: torch.Tensor, cp_group=None) -> torch.Tensor:
    """``[batch]`` valid length of each sample, summed over context-parallel ranks if ``cp_group``.

    Under CP each rank holds a slice of every sample's tokens, so |o_i| is the sum of the local
    counts over the CP group (one all-reduce). float64: exact for any realistic length.
    """
    lengths = mask.sum(-1, dtype=torch.float64)
    if cp_group is not None and _world(cp_group) > 1:
        dist.all_reduce(lengths, group=cp_group)
    return lengths


def compute_step_normalizer(
    masks: Sequence[torch.Tensor] | torch.Tensor,
    loss_agg_mode: str = "token-mean",
    l_norm: float | None = None,
    group=None,
    *,
    cp_group=None,
    device: torch.device | str | None = None,
) -> StepNormalizer:
    """Count tokens, sequences and the longest sequence over the whole step; ONE collective.

    Args:
        masks: this rank's loss masks, one ``[batch, seq]`` tensor per micro-batch (a single
            tensor is taken as one micro-batch). Pass the masks the loss will use, i.e. after
            ``mask_truncated``.
        loss_agg_mode: recorded so ``policy_loss`` can refuse a mismatched normalizer.
        l_norm: Dr. GRPO's L_norm for ``seq-mean-token-sum-norm``; None = the longest sample of
            the step. Passing the generation budget (max response length) keeps it constant
            across steps as in the paper (arXiv:2503.20783 §3.2).
        group: process group spanning every rank that holds a distinct part of the step: the
            DP ranks and, with context parallelism, the CP ranks (Megatron's
            ``get_data_parallel_group(with_context_parallel=True)``). None = no communication
            (this process holds the whole step). Unlike torch.distributed, None is NOT WORLD.
        cp_group: the context-parallel group when CP > 1: each CP rank holds a slice of every
            sample, so per-sample lengths are first summed over it (one extra all-reduce) and
            sequences are counted on CP rank 0 only.
        device: device for the collective when ``masks`` is empty (NCCL needs a CUDA tensor).

    Returns:
        A ``StepNormalizer`` with identical values on every rank of ``group``.

    Communication: one ``all_gather`` of three float64 numbers over ``group`` (sums for the
    counts, max for the length, reduced locally, so one collective serves both reductions),
    plus one all-reduce of the per-sample lengths over ``cp_group`` if given.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")
    finite_number(l_norm, "l_norm", low=0.0, low_open=True, allow_none=True)
    if torch.is_tensor(masks):
        masks = [masks]
    masks = [check_mask(m, f"masks[{i}]") for i, m in enumerate(masks)]
    dev = torch.device(device) if device is not None else (masks[0].device if masks else torch.device("cpu"))

    if masks:
        row_lengths = torch.cat([m.sum(-1, dtype=torch.float64).reshape(-1) for m in masks]).to(dev)
    else:
        row_lengths = torch.zeros(0, dtype=torch.float64, device=dev)
    local_tokens = row_lengths.sum().item()  # this rank's tokens (before the CP sum below)
    cp_rank = 0
    if cp_group is not None and _world(cp_group) > 1:
        dist.all_reduce(row_lengths, group=cp_group)  # one collective for all micro-batches
        cp_rank = dist.get_rank(cp_group)
    local_seqs = float((row_lengths > 0).sum()) if cp_rank == 0 else 0.0
    local_max = float(row_lengths.max()) if row_lengths.numel() else 0.0

    stats = torch.tensor([local_tokens, local_seqs, local_max], dtype=torch.float64, device=dev)
    if group is not None and _world(group) > 1:
        gathered = [torch.empty_like(stats) for _ in range(_world(group))]
        dist.all_gather(gathered, stats, group=group)
        table = torch.stack(gathered)
        tokens, seqs = table[:, 0].sum().item(), table[:, 1].sum().item()
        longest = table[:, 2].max().item()
    else:
        tokens, seqs, longest = local_tokens, local_seqs, local_max
    if not (math.isfinite(tokens) and math.isfinite(seqs)):
        raise ValueError(f"step counts are not finite: tokens={tokens}, sequences={seqs}")
    return StepNormalizer(
        loss_agg_mode=loss_agg_mode,
        num_tokens=tokens,
        num_sequences=seqs,
        max_length=longest,
        l_norm=float(l_norm) if l_norm is not None else max(longest, 1.0),
    )
