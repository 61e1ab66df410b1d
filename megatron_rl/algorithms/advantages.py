"""Group-relative advantage estimators (critic-free, GRPO family).

Inputs are rewards shaped ``[groups, G]``: row ``g`` holds the ``G`` sampled responses of one
prompt. All estimators subtract a per-prompt baseline computed from the group itself, so no
value network is needed; they differ in the baseline and in the scale:

============================== ==================================================== =====================
estimator                      advantage of response i in its group                 paper
============================== ==================================================== =====================
``grpo``                       (r_i - mean) / (std + eps)                           DeepSeekMath §4.1.2
``dr_grpo``                    r_i - mean                                           Dr. GRPO §3.2
``rloo``                       r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean)         RLOO (Ahmadian 2024)
``reinforce_plus_plus_baseline`` (r_i - mean) whitened over the WHOLE batch          REINFORCE++ §3
``grpo_process``               sum of group-normalized step rewards from t on       DeepSeekMath §4.1.3
============================== ==================================================== =====================

Why the std estimator is selectable: ``torch.std`` (unbiased, the default here as in verl and
TRL) and the population std differ by sqrt(G/(G-1)), a 15% scale difference at G=4 that is
easy to mistake for a learning-rate change. Papers' worked examples usually use the population
std (e.g. rewards 1.1, 0.1, 0.0, 1.1 give +0.998, -0.903, -1.093, +0.998 only with it).

A group whose rewards are all equal has zero advantage under every estimator (0 / (0 + eps) for
``grpo``): it carries no learning signal, never a NaN. ``shaping.zero_spread_groups`` finds such
groups so the trainer can drop them (DAPO dynamic sampling). G = 1 is rejected: a group of one
has no baseline (and ``torch.std`` of one value is NaN).
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms._checks import check_mask, finite_number
from megatron_rl.algorithms.names import ADVANTAGE_ESTIMATORS

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "STD_ESTIMATORS",
    "compute_advantages",
    "grpo_advantages",
    "dr_grpo_advantages",
    "rloo_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "process_advantages",
]

STD_ESTIMATORS = ("unbiased", "population")


def _as_float(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_floating_point() else x.to(torch.float32)


def _check_rewards(rewards, name: str = "rewards", dim: int = 2) -> torch.Tensor:
    if not torch.is_tensor(rewards) or rewards.is_complex():
        raise ValueError(f"{name} must be a real tensor, got {getattr(rewards, 'dtype', type(rewards).__name__)}")
    if rewards.dim() != dim:
        shape = "[groups, G]" if dim == 2 else "[groups, G, seq]"
        raise ValueError(f"{name} must be shaped {shape}, got shape {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        raise ValueError(
            f"group size G={rewards.shape[1]} (dim 1 of {name}): group-relative advantages need at "
            f"least 2 responses per prompt (a group of one has no baseline)"
        )
    rewards = _as_float(rewards)
    if rewards.numel() and not bool(torch.isfinite(rewards).all()):
        n_bad = int((~torch.isfinite(rewards)).sum())
        raise ValueError(f"{name} contains {n_bad} non-finite value(s) (NaN or inf)")
    return rewards


def _check_std(std: str, eps: float) -> None:
    if std not in STD_ESTIMATORS:
        raise ValueError(f"std must be one of {STD_ESTIMATORS}, got {std!r}")
    finite_number(eps, "eps", low=0.0)


def _correction(std: str) -> int:
    return 1 if std == "unbiased" else 0


def grpo_advantages(rewards: torch.Tensor, *, std: str = "unbiased", eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantage ``(r_i - mean) / (std + eps)`` per group.

    DeepSeekMath (Shao et al. 2024, arXiv:2402.03300) §4.1.2 "Outcome Supervision RL with GRPO".
    ``std="unbiased"`` is ``torch.std`` (Bessel-corrected), ``"population"`` divides by G.
    """
    rewards = _check_rewards(rewards)
    _check_std(std, eps)
    mean = rewards.mean(dim=1, keepdim=True)
    sd = rewards.std(dim=1, keepdim=True, correction=_correction(std))
    return (rewards - mean) / (sd + eps)


def dr_grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO advantage ``r_i - mean``: no std division (removes the difficulty bias).

    Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
    (arXiv:2503.20783) §3.2; verl ``norm_adv_by_std_in_grpo=False``, TRL ``scale_rewards="none"``.
    """
    rewards = _check_rewards(rewards)
    return rewards - rewards.mean(dim=1, keepdim=True)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out: ``r_i - mean_{j != i} r_j``, an unbiased per-sample baseline.

    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning
    from Human Feedback in LLMs" (arXiv:2402.14740) §3.2 (Kool et al. 2019). Equal to
    ``G / (G - 1) * (r_i - mean)``.
    """
    rewards = _check_rewards(rewards)
    g = rewards.shape[1]
    loo_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (g - 1)
    return rewards - loo_mean


def reinforce_plus_plus_baseline_advantages(
    rewards: torch.Tensor,
    *,
    std: str = "unbiased",
    eps: float = 1e-6,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE++-baseline: subtract the group mean, then normalize over the whole batch.

    Hu et al. 2025, "REINFORCE++" (arXiv:2501.03262) §3 (the "-baseline" variant for group
    sampling): the group mean removes the prompt's difficulty, and the global (batch) mean/std
    normalization keeps the scale stable without the per-group std's difficulty bias.

    Args:
        lengths: optional ``[groups, G]`` response lengths. When given, the batch statistics are
            token-weighted (each response counts once per token), which is what verl computes by
            whitening the broadcast per-token advantages under the response mask.
    """
    rewards = _check_rewards(rewards)
    _check_std(std, eps)
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if lengths is None:
        w = torch.ones_like(centered)
    else:
        if tuple(lengths.shape) != tuple(rewards.shape):
            raise ValueError(f"lengths shape {tuple(lengths.shape)} must equal rewards shape {tuple(rewards.shape)}")
        if lengths.numel() and bool((lengths < 0).any()):
            raise ValueError(f"lengths must be >= 0, found {lengths.min().item()}")
        w = lengths.to(centered.dtype)
    total = w.sum()
    if total <= _correction(std):
        raise ValueError(f"batch too small for a {std} std: total weight {total.item()}")
    mean = (w * centered).sum() / total
    var = (w * (centered - mean) ** 2).sum() / (total - _correction(std))
    return (centered - mean) / (var.sqrt() + eps)


def process_advantages(
    step_rewards: torch.Tensor,
    step_mask: torch.Tensor,
    *,
    std: str = "unbiased",
    eps: float = 1e-6,
    normalize_by_std: bool = True,
) -> torch.Tensor:
    """GRPO with process supervision: per-token advantage = sum of normalized future step rewards.

    DeepSeekMath (arXiv:2402.03300) §4.1.3 "Process Supervision RL with GRPO". A process reward
    model scores each reasoning step k of response i; its reward sits at the step's last token
    ``index(i, k)``. Step rewards are normalized with the mean and std over ALL step rewards of
    the group (every response, every step), then
    ``A_{i,t} = sum_{k : index(i,k) >= t} normalized_r_i^(k)``.
    Tokens after the last step get 0.

    Args:
        step_rewards: ``[groups, G, seq]``, the reward of a step at its end token (other
            positions are ignored).
        step_mask: ``[groups, G, seq]`` bool / 0-1, True at step-end tokens.
        normalize_by_std: False gives the mean-only (Dr. GRPO-style) version.

    Returns:
        ``[groups, G, seq]`` per-token advantages (reshape to ``[batch, seq]`` for the loss).

    A group with a single step reward normalizes it to 0 (its own mean) for either std estimator.
    """
    step_rewards = _check_rewards(step_rewards, "step_rewards", dim=3)
    m = check_mask(step_mask, "step_mask", dim=3)
    if tuple(m.shape) != tuple(step_rewards.shape):
        raise ValueError(f"step_mask shape {tuple(m.shape)} must equal step_rewards shape {tuple(step_rewards.shape)}")
    _check_std(std, eps)
    mf = m.to(step_rewards.dtype)
    r = step_rewards * mf
    n = mf.sum(dim=(1, 2), keepdim=True)
    mean = r.sum(dim=(1, 2), keepdim=True) / n.clamp(min=1)
    dev = (step_rewards - mean) * mf
    if normalize_by_std:
        # With one step, dev is 0, so clamping the divisor to 1 gives var = 0 and r~ = 0.
        var = (dev**2).sum(dim=(1, 2), keepdim=True) / (n - _correction(std)).clamp(min=1)
        dev = dev / (var.sqrt() + eps)
    # A_t = sum over steps ending at or after t: a reversed cumulative sum along the sequence.
    return dev.flip(-1).cumsum(-1).flip(-1)


def compute_advantages(
    rewards: torch.Tensor,
    estimator: str = "grpo",
    *,
    std: str = "unbiased",
    eps: float = 1e-6,
    lengths: torch.Tensor | None = None,
    step_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages from rewards shaped ``[groups, G]`` (public entry point).

    Args:
        rewards: ``[groups, G]`` outcome rewards, or ``[groups, G, seq]`` step rewards for
            ``estimator="grpo_process"``.
        estimator: one of ``ADVANTAGE_ESTIMATORS`` (see the module docstring).
        std: ``"unbiased"`` (as ``torch.std``, default) or ``"population"``; used by ``grpo``,
            ``reinforce_plus_plus_baseline`` and ``grpo_process``.
        eps: added to the std before dividing.
        lengths: response lengths for the token-weighted ``reinforce_plus_plus_baseline``.
        step_mask: step-end positions for ``grpo_process``.

    Returns:
        ``[groups, G]`` per-response advantages (``[groups, G, seq]`` for ``grpo_process``), in
        the rewards' floating dtype (float32 for integer/bool rewards). Flatten to ``[batch]``
        (or ``[batch, seq]``) in the same sample order for ``policy_loss``.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"estimator must be one of {ADVANTAGE_ESTIMATORS}, got {estimator!r}")
    if estimator != "grpo_process" and step_mask is not None:
        raise ValueError(f"step_mask is only used by estimator='grpo_process', got estimator={estimator!r}")
    if estimator != "reinforce_plus_plus_baseline" and lengths is not None:
        raise ValueError(f"lengths is only used by estimator='reinforce_plus_plus_baseline', got {estimator!r}")
    if estimator == "grpo":
        return grpo_advantages(rewards, std=std, eps=eps)
    if estimator == "dr_grpo":
        return dr_grpo_advantages(rewards)
    if estimator == "rloo":
        return rloo_advantages(rewards)
    if estimator == "reinforce_plus_plus_baseline":
        return reinforce_plus_plus_baseline_advantages(rewards, std=std, eps=eps, lengths=lengths)
    if step_mask is None:
        raise ValueError("estimator='grpo_process' needs step_mask (True at each step's last token)")
    return process_advantages(rewards, step_mask, std=std, eps=eps)
