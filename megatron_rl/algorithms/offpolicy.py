"""Off-policy corrections against the rollout engine's own per-token logprobs (mu), and the
train/inference mismatch metrics.

The engine samples from mu; the trainer's old policy pi_old (its logprobs at the step's start)
differs from mu by precision, kernels, MoE routing and, asynchronously, by policy versions. Per
token, rho_t = pi_old(y_t) / mu(y_t). The corrections (``PolicyLossConfig`` fields in brackets;
``rl.off_policy`` names them, see docs/algorithms.md):

* TIS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training")
  [tis_mode="truncate"]: the loss term is multiplied by ``min(rho, upper)`` (token level) or by the
  truncated product over the sample's tokens (sequence level); every token stays in the loss.
* IcePop (Ring-1T, arXiv:2510.18855) [token, "mask", lower, upper]: a token whose rho leaves
  [lower, upper] is masked; inside the band its rho corrects.
* MIS, masked importance sampling (Liu, Li et al. 2025, "When Speed Kills Stability")
  [tis_mode="mask", lower None]: a weight above the threshold drops the token (token level) or
  the whole sequence (sequence level: the product over its tokens) instead of being truncated.
* DeepSeek-V3.2's off-policy sequence mask (arXiv:2512.02556 §3.1) [opsm_delta]: a sample with
  negative advantage whose KL from the sampling policy, ``1/|o_i| sum_t (log mu(y_t) - log
  pi_theta(y_t))`` over its loss tokens (the k1 estimate of KL(mu || pi_theta) on tokens mu
  sampled), exceeds delta is dropped. pi_theta is the policy being updated (DeepSeek: "the KL
  divergence between the old and current policy accounts for both sources of off-policyness").
  With per-token advantages the condition is per token, as in the paper's M_{i,t}.

A masked token leaves the loss entirely, its normaliser included: it is no longer counted in
N_tokens, in its sample's |o_i|, nor (with all its tokens masked) in N_seqs. So the step's
``StepNormalizer`` must be computed from the masks ``off_policy_keep`` returns, which depend
only on constants of the step (pi_old, mu, the advantages, and pi_theta at the update's start).
The weights are constants (no gradient).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_rl.algorithms._checks import check_float, check_mask, check_same_shape
from megatron_rl.algorithms._cp import cp_world, masked_max, masked_min, sum_over_cp
from megatron_rl.algorithms.normalization import sequence_lengths

__all__ = ["ImportanceWeight", "Correction", "truncated_importance_weight", "opsm_drop", "off_policy_correction",
           "off_policy_keep", "mismatch_metrics"]

_LOG_CLAMP = 20.0  # metrics only: bounds exp() so a wild token cannot make a step's metric inf


class ImportanceWeight(NamedTuple):
    """Importance weight per token, and which valid tokens it truncated / rejected."""

    weight: torch.Tensor
    truncated: torch.Tensor
    rejected: torch.Tensor


class Correction(NamedTuple):
    """What the step's off-policy corrections do to one micro-batch (all bool tensors cover valid
    tokens only): ``tis`` the importance weight (None: no weight), ``opsm`` the tokens
    DeepSeek-V3.2's sequence mask drops (None: off), ``keep`` the valid tokens that stay."""

    tis: ImportanceWeight | None
    opsm: torch.Tensor | None
    keep: torch.Tensor


def truncated_importance_weight(
    log_weight: torch.Tensor,
    valid: torch.Tensor,
    level: str = "token",
    mode: str = "truncate",
    upper: float = 2.0,
    lower: float | None = None,
    cp_group=None,
) -> ImportanceWeight:
    """Importance weight of the trainer's old policy over the sampling (rollout) policy.

    ``log_weight`` is the per-token ``log pi_old - log pi_rollout`` (zero at invalid tokens).

    * ``level="token"``: ``w_t = pi_old(y_t) / pi_rollout(y_t)``; ``"sequence"``: the product
      over the sample's tokens (summed over ``cp_group`` under CP), broadcast to its tokens.
    * ``mode="truncate"`` (TIS): ``w <- clip(w, lower, upper)`` (``lower`` None = 0).
    * ``mode="mask"`` (IcePop with both bounds at token level; MIS with ``lower`` None):
      ``w <- 0`` outside ``[lower, upper]``, ``w`` inside.

    The weight is a constant (no gradient). With rollouts from older policy versions (async RL)
    the token-level truncated weight is the behaviour correction of AReaL's decoupled PPO
    objective (arXiv:2505.24298 Eq. 5), ``pi_prox / pi_behav``.
    """
    if level == "token":
        log_w = log_weight
    else:
        log_w = sum_over_cp(log_weight.sum(-1), cp_group, differentiable=False)
        log_w = log_w.unsqueeze(-1).expand_as(log_weight)
    log_hi = math.log(upper)
    log_lo = math.log(lower) if lower is not None else -math.inf
    outside = (log_w > log_hi) | (log_w < log_lo)
    if mode == "truncate":
        w = torch.exp(log_w.clamp(min=log_lo, max=log_hi))
        return ImportanceWeight(w, valid & outside, torch.zeros_like(valid))
    zero = torch.zeros((), dtype=log_w.dtype, device=log_w.device)
    w = torch.where(outside, zero, torch.exp(log_w.clamp(max=log_hi)))
    return ImportanceWeight(w, torch.zeros_like(valid), valid & outside)


def opsm_drop(rollout_logprobs: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor,
              seq_len: torch.Tensor, delta: float, cp_group=None) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask: the valid tokens it drops.

    ``KL_i = 1/|o_i| sum_t (log mu(y_t) - log pi_theta(y_t))`` over sample i's valid tokens
    (``seq_len`` = |o_i|, over all CP slices); a token is dropped where ``A_{i,t} < 0`` and
    ``KL_i > delta``. Inputs ``[batch, seq]``, zero at invalid tokens; ``logprobs`` is pi_theta
    (detached by the caller)."""
    diff = torch.where(valid, rollout_logprobs - logprobs, torch.zeros((), dtype=logprobs.dtype,
                                                                         device=logprobs.device))
    kl = sum_over_cp(diff.sum(-1), cp_group, differentiable=False) / seq_len.clamp(min=1.0)
    return valid & (advantages < 0) & (kl.unsqueeze(-1) > delta)


def off_policy_correction(cfg, valid: torch.Tensor, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor | None,
                          advantages: torch.Tensor, logprobs: torch.Tensor, seq_len: torch.Tensor,
                          cp_group=None) -> Correction | None:
    """The corrections ``cfg`` (a PolicyLossConfig) asks for, decided in float64 from the given
    constants (so the trainer's ``off_policy_keep`` and the loss decide alike in any dtype).
    Inputs ``[batch, seq]`` and zero at invalid tokens; ``advantages`` per token; ``logprobs`` is
    pi_theta for the sequence mask. None when ``cfg`` has no correction."""
    if cfg.tis_level is None and cfg.opsm_delta is None:
        return None
    old, roll = old_logprobs.detach().double(), rollout_logprobs.detach().double()
    tis = None
    keep = valid
    if cfg.tis_level is not None:
        tis = truncated_importance_weight(old - roll, valid, cfg.tis_level, cfg.tis_mode, cfg.tis_upper,
                                          cfg.tis_lower, cp_group)
        keep = keep & ~tis.rejected
    opsm = None
    if cfg.opsm_delta is not None:
        opsm = opsm_drop(roll, logprobs.detach().double(), advantages.detach(), valid, seq_len.double(),
                         cfg.opsm_delta, cp_group)
        keep = keep & ~opsm
    return Correction(tis, opsm, keep)


def off_policy_keep(mask: torch.Tensor, cfg, *, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor | None,
                    advantages: torch.Tensor, logprobs: torch.Tensor | None = None, cp_group=None) -> torch.Tensor:
    """The loss-mask tokens that stay in the loss under ``cfg``'s off-policy corrections: pass
    these masks (one per micro-batch) to ``compute_step_normalizer``, so that masked tokens
    leave the normaliser; ``policy_loss`` itself still takes the plain loss mask.

    ``logprobs``: pi_theta at the update's start, needed for ``opsm_delta`` (pass the same
    tensor to ``policy_loss(..., opsm_logprobs=...)``). Returns ``mask`` as bool when ``cfg``
    masks nothing."""
    m = check_mask(mask)
    if not cfg.masks_tokens:
        return m
    check_float(old_logprobs, "old_logprobs", dim=2)
    check_same_shape(old_logprobs, m, "old_logprobs", "mask")
    if rollout_logprobs is None:
        raise ValueError("off-policy masks need rollout_logprobs (the engine's per-token logprobs)")
    check_same_shape(rollout_logprobs, m, "rollout_logprobs", "mask")
    if cfg.opsm_delta is not None:
        if logprobs is None:
            raise ValueError(f"opsm_delta={cfg.opsm_delta} needs logprobs: pi_theta at the update's start")
        check_same_shape(logprobs, m, "logprobs", "mask")
    zero = torch.zeros((), dtype=torch.float64, device=m.device)

    def clean(x):
        return torch.where(m, x.detach().double(), zero)

    adv = advantages.detach().double()
    adv = adv.unsqueeze(-1).expand(m.shape) if adv.dim() == 1 else adv
    seq_len = sequence_lengths(m, cp_group)
    lp = clean(logprobs) if logprobs is not None else zero.expand(m.shape)
    return off_policy_correction(cfg, m, clean(old_logprobs), clean(rollout_logprobs), clean(adv), lp, seq_len,
                                 cp_group).keep


def mismatch_metrics(valid: torch.Tensor, seq_len: torch.Tensor, train_vs_rollout: torch.Tensor,
                     correction: Correction | None, cp_group=None) -> dict[str, torch.Tensor]:
    """The train/rollout mismatch over the loss-mask tokens (before any correction masks them),
    as combinable sums (``metrics.reduce_metrics``), with ``d = log pi_old - log mu`` per token:

    ``mismatch/tokens``, ``mismatch/sequences`` (the population), ``mismatch/logp_abs_diff_mean``
    / ``_max`` (|d|), ``mismatch/kl`` (k3 estimate of KL(mu || pi_old), ``e^d - 1 - d``, Schulman
    2020 "Approximating KL Divergence", on tokens mu sampled), ``mismatch/chi2_token``
    (``E_mu[rho^2] - 1``) and ``mismatch/chi2_seq`` (``E_mu[(prod_t rho_t)^2] - 1`` over samples),
    ``mismatch/masked_frac`` (the share of loss-mask tokens that the corrections took out of the
    loss); with the sequence mask ``mismatch/opsm_seq_frac`` (the share of samples it touched);
    with an importance weight ``tis/weight_mean`` / ``_max`` / ``_min``, ``tis/truncated_frac``,
    ``tis/masked_frac`` over ``tis/tokens``. exp() arguments are clamped to +-20 (metrics only)."""
    vf = valid.to(torch.float64)
    d = torch.where(valid, train_vs_rollout.detach().double(), torch.zeros((), dtype=torch.float64,
                                                                           device=valid.device))
    bounded = d.clamp(-_LOG_CLAMP, _LOG_CLAMP)
    cp_rank = dist.get_rank(cp_group) if cp_world(cp_group) > 1 else 0
    first = 1.0 if cp_rank == 0 else 0.0  # under CP every rank sees every sample: count on rank 0
    has_tokens = seq_len > 0
    seq_log = sum_over_cp(d.sum(-1), cp_group, differentiable=False).clamp(-_LOG_CLAMP, _LOG_CLAMP)
    kept = correction.keep if correction is not None else valid

    def tok_sum(x: torch.Tensor) -> torch.Tensor:
        return (x * vf).sum()

    metrics = {
        "mismatch/tokens/sum": vf.sum(),
        "mismatch/sequences/sum": has_tokens.sum().to(torch.float64) * first,
        "mismatch/logp_abs_diff_mean/sub_tok_sum": tok_sum(d.abs()),
        "mismatch/logp_abs_diff_max/max": masked_max(d.abs(), valid),
        "mismatch/kl/sub_tok_sum": tok_sum(torch.expm1(bounded) - bounded),
        "mismatch/chi2_token/sub_tok_sum": tok_sum(torch.expm1(2 * bounded)),
        "mismatch/chi2_seq/sub_seq_sum": (torch.expm1(2 * seq_log) * has_tokens).sum() * first,
        "mismatch/masked_frac/sub_tok_sum": (valid & ~kept).sum().to(torch.float64),
    }
    if correction is not None and correction.opsm is not None:
        touched = sum_over_cp(correction.opsm.sum(-1).double(), cp_group, differentiable=False) > 0
        metrics["mismatch/opsm_seq_frac/sub_seq_sum"] = touched.sum().to(torch.float64) * first
    if correction is not None and correction.tis is not None:
        tis = correction.tis
        metrics.update({
            "tis/tokens/sum": vf.sum(),
            "tis/weight_mean/sub_tok_sum": tok_sum(tis.weight.double()),
            "tis/weight_max/max": masked_max(tis.weight, valid),
            "tis/weight_min/min": masked_min(tis.weight, valid),
            "tis/truncated_frac/sub_tok_sum": (tis.truncated & valid).sum().to(torch.float64),
            "tis/masked_frac/sub_tok_sum": (tis.rejected & valid).sum().to(torch.float64),
        })
    return metrics
