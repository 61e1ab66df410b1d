"""Loss aggregation modes: how per-token terms become one scalar (verl's ``loss_agg_mode``).

Every mode is a weighted sum ``sum_{i,t} w_{i,t} * x_{i,t}`` over valid tokens, with weights
from counts of the WHOLE optimizer step (``StepNormalizer``) and, for seq-mean-token-mean, the
sample's own length |o_i| (a sample is never split across micro-batches, so |o_i| is local):

============================ ================================ =====================================
mode                         w_{i,t}                          origin
============================ ================================ =====================================
``token-mean``               1 / N_tokens                     DAPO (arXiv:2503.14476 §3.3, Eq. 12)
``seq-mean-token-mean``      1 / (N_seqs * |o_i|)             GRPO (arXiv:2402.03300 Eq. 3)
``seq-mean-token-sum``       1 / N_seqs                       sum over tokens, mean over samples
``seq-mean-token-sum-norm``  1 / (N_seqs * L_norm)            Dr. GRPO (arXiv:2503.20783 §3.2)
``token-sum``                1                                plain sum (no normalization)
============================ ================================ =====================================

With one group of G samples these are GRPO's ``1/G sum_i 1/|o_i| sum_t`` and Dr. GRPO's
``1/(G L_norm) sum_i sum_t``. Because the weights depend only on step-level counts and on
per-sample lengths, the sum over micro-batches (and DP/CP ranks) of each micro-batch's weighted
sum is exactly the full-batch value: gradients do not depend on how the batch was split.
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms._checks import check_mask
from megatron_rl.algorithms.normalization import LOSS_AGG_MODES, compute_step_normalizer

__all__ = ["LOSS_AGG_MODES", "token_weights", "agg_loss"]



def _inv(x: float) -> float:
    return 1.0 / x if x > 0 else 0.0  # no valid tokens/sequences anywhere: every weight is 0


def token_weights(
    mask: torch.Tensor,
    seq_lengths: torch.Tensor,
    normalizer,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Per-token weights ``[batch, seq]`` of the micro-batch's share of the step loss.

    Args:
        mask: ``[batch, seq]`` bool, tokens that contribute (0 weight elsewhere).
        seq_lengths: ``[batch]`` |o_i| (the sample's full valid length; all-reduced over CP
            when the sample's tokens are spread over context-parallel ranks).
        normalizer: the step's ``StepNormalizer`` (its ``loss_agg_mode`` selects the mode).
    """
    mode = normalizer.loss_agg_mode
    valid = mask.to(dtype)
    if mode == "token-mean":
        return valid * _inv(normalizer.num_tokens)
    if mode == "token-sum":
        return valid
    inv_seqs = _inv(normalizer.num_sequences)
    if mode == "seq-mean-token-mean":
        per_seq = inv_seqs / seq_lengths.to(dtype).clamp(min=1.0)
        return valid * per_seq.unsqueeze(-1)
    if mode == "seq-mean-token-sum":
        return valid * inv_seqs
    if mode == "seq-mean-token-sum-norm":
        return valid * (inv_seqs * _inv(normalizer.l_norm))
    raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {mode!r}")


def agg_loss(
    values: torch.Tensor,
    mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    normalizer=None,
    *,
    l_norm: float | None = None,
) -> torch.Tensor:
    """Aggregate per-token ``values [batch, seq]`` into this micro-batch's share of the step value.

    ``normalizer=None`` treats this call as the whole step (counts from ``mask``, no
    communication). Positions outside ``mask`` are ignored even if they hold NaN/inf.
    """

    m = check_mask(mask)
    if tuple(values.shape) != tuple(m.shape):
        raise ValueError(f"values shape {tuple(values.shape)} must equal mask shape {tuple(m.shape)}")
    if normalizer is None:
        normalizer = compute_step_normalizer([m], loss_agg_mode=loss_agg_mode, l_norm=l_norm)
    elif normalizer.loss_agg_mode != loss_agg_mode:
        raise ValueError(
            f"normalizer was computed for loss_agg_mode={normalizer.loss_agg_mode!r}, not {loss_agg_mode!r}"
        )
    dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
    w = token_weights(m, m.sum(-1), normalizer, dtype)
    return (torch.where(m, values.to(dtype), 0.0) * w).sum()
