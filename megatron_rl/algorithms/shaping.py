"""Reward shaping and sample filtering from DAPO (Yu et al. 2025, arXiv:2503.14476).

* Overlong reward shaping (§3.4, Eq. 13): a linear length penalty over a soft budget just
  below the hard generation cap, so the policy learns to stop before being cut off instead of
  being punished arbitrarily for a truncated but otherwise good answer.
* Truncated-completion masking ("overlong filtering", §3.4): drop the loss of responses cut
  off at the cap, whose reward says nothing reliable about the reasoning.
* Dynamic sampling (§3.2): groups whose rewards are all equal have zero advantage and add no
  gradient; find them so the trainer drops them and samples more prompts to refill the batch.

These are pure functions of rewards, lengths and masks; the trainer decides when to apply them
(shaping before ``compute_advantages``, filtering after scoring, masking before the loss).
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms._checks import check_mask, finite_number

__all__ = [
    "overlong_penalty",
    "apply_overlong_penalty",
    "is_truncated",
    "mask_truncated",
    "zero_spread_groups",
    "dynamic_sampling_keep",
]


def _check_lengths(lengths, name: str = "lengths") -> torch.Tensor:
    if not torch.is_tensor(lengths) or lengths.is_complex() or lengths.dtype == torch.bool:
        got = getattr(lengths, "dtype", type(lengths).__name__)
        raise ValueError(f"{name} must be a real tensor of token counts, got {got}")
    if lengths.numel() and bool((lengths < 0).any()):
        raise ValueError(f"{name} must be >= 0, found {lengths.min().item()}")
    return lengths


def overlong_penalty(
    lengths: torch.Tensor,
    *,
    max_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment (arXiv:2503.14476 §3.4, Eq. 13), an ADDITIVE reward term.

    With hard cap ``L_max = max_length`` and buffer ``L_cache = buffer_length``::

        0                                   if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max   (linear, 0 -> -1)
        -1                                  if |y| > L_max

    times ``penalty_factor`` (verl's ``overlong_penalty_factor``). Returns a float tensor shaped
    like ``lengths`` with values in ``[-penalty_factor, 0]``.
    """
    lengths = _check_lengths(lengths)
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be a positive int, got {max_length!r}")
    if isinstance(buffer_length, bool) or not isinstance(buffer_length, int) or not 0 < buffer_length <= max_length:
        raise ValueError(f"buffer_length must be an int in [1, max_length={max_length}], got {buffer_length!r}")
    finite_number(penalty_factor, "penalty_factor", low=0.0)
    soft = max_length - buffer_length
    x = lengths.to(torch.float64)
    ramp = ((soft - x) / buffer_length).clamp(min=-1.0, max=0.0)  # 0 below the soft budget, -1 at the cap
    pen = torch.where(x > max_length, torch.full_like(x, -1.0), ramp) * penalty_factor
    return pen.to(torch.get_default_dtype() if not lengths.is_floating_point() else lengths.dtype)


def apply_overlong_penalty(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    *,
    max_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """``rewards + overlong_penalty(lengths)`` (DAPO §3.4); same shape and dtype as ``rewards``."""
    if tuple(rewards.shape) != tuple(lengths.shape):
        raise ValueError(f"rewards shape {tuple(rewards.shape)} must equal lengths shape {tuple(lengths.shape)}")
    rewards = rewards if rewards.is_floating_point() else rewards.to(torch.float32)
    pen = overlong_penalty(lengths, max_length=max_length, buffer_length=buffer_length, penalty_factor=penalty_factor)
    return rewards + pen.to(rewards.dtype)


def is_truncated(lengths: torch.Tensor, max_length: int) -> torch.Tensor:
    """True where a response hit the generation cap (``length >= max_length``).

    Prefer the rollout engine's finish reason (``"length"``) when available: a response that
    ends with EOS exactly at the cap is complete, which lengths alone cannot tell.
    """
    lengths = _check_lengths(lengths)
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be a positive int, got {max_length!r}")
    return lengths >= max_length


def mask_truncated(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Zero the loss mask of truncated samples (DAPO "overlong filtering", §3.4).

    Args:
        mask: ``[batch, seq]`` loss mask (bool or 0/1); returned in the same dtype.
        truncated: ``[batch]`` bool, True for samples cut off at the cap.

    A fully masked sample then contributes nothing and is not counted as a sequence by
    ``compute_step_normalizer``; compute the normalizer from the masks AFTER this call.
    """
    m = check_mask(mask, "mask")
    t = check_mask(truncated, "truncated", dim=1)
    if t.shape[0] != m.shape[0]:
        raise ValueError(f"truncated has {t.shape[0]} entries but mask has {m.shape[0]} rows")
    keep = m & ~t.unsqueeze(1)
    return keep if mask.dtype == torch.bool else keep.to(mask.dtype)


def zero_spread_groups(rewards: torch.Tensor, *, atol: float = 0.0) -> torch.Tensor:
    """``[groups]`` bool: True where all G rewards of a group are equal (max - min <= atol).

    DAPO dynamic sampling (arXiv:2503.14476 §3.2, Eq. 11 constraint
    ``0 < |{o_i : is_equivalent(a, o_i)}| < G``): such groups have zero advantage under every
    group-relative estimator, so they cost a backward pass and teach nothing. TRL logs their
    share as ``frac_reward_zero_std``.
    """
    if not torch.is_tensor(rewards) or rewards.dim() != 2:
        raise ValueError(f"rewards must be shaped [groups, G], got {getattr(rewards, 'shape', type(rewards).__name__)}")
    finite_number(atol, "atol", low=0.0)
    if rewards.shape[1] == 0:
        raise ValueError("rewards has G=0 responses per group")
    spread = rewards.amax(dim=1) - rewards.amin(dim=1)
    return spread <= atol


def dynamic_sampling_keep(rewards: torch.Tensor, *, atol: float = 0.0) -> torch.Tensor:
    """``[groups]`` bool: groups to keep under DAPO dynamic sampling (reward spread > atol)."""
    return ~zero_spread_groups(rewards, atol=atol)
