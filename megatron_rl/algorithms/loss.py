"""The policy-gradient loss of one micro-batch: surrogate, regularizers, metrics.

``policy_loss`` returns this micro-batch's share of the optimizer step's loss, already divided
by counts of the whole step (``StepNormalizer``), because the training step sums micro-batch
gradients over micro-batches and DP ranks without any further scaling. Summing the returned
losses (and gradients) over every micro-batch and rank gives exactly the full-batch loss and
gradient, for every aggregation mode and ratio level.

Per valid token (sample i, position t), with A the advantage and r the importance ratio:

* PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347 Eq. 7) with decoupled
  eps_low/eps_high (DAPO clip-higher, arXiv:2503.14476 §3.1)::

      l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))

  and, with dual clip (Ye et al. 2020, arXiv:1912.09729 §4.2), ``l = min(l, -c A)`` where A < 0.
* CISPO (MiniMax-M1, arXiv:2506.13585 §3.1, Eq. 4): ``l = -sg(clip(r, 1-eps_low, 1+eps_high)) A log pi``.
* Ratio: token ``r_t = exp(logp_t - logp_old_t)``; sequence (GSPO, arXiv:2507.18071 Eq. 7)
  ``s_i = exp(mean_t (logp - logp_old))`` over the sample's valid tokens; sequence_token
  (GSPO-token, Eq. 13) ``exp(logp_t - sg(logp_t) + sg(log s_i))``.
* Off-policy corrections against the engine's logprobs (``offpolicy.py``): ``l *= w`` with
  ``w = pi_old / pi_rollout`` (token, or product over the sample), truncated (TIS) or masked
  (IcePop, MIS); DeepSeek-V3.2's sequence mask. Masked tokens leave the loss and its normaliser.
  With asynchronous rollouts token TIS is AReaL's decoupled PPO objective (arXiv:2505.24298
  Eq. 5), see ``policy_loss``.
* KL to the reference (DeepSeekMath arXiv:2402.03300 Eq. 3-4): ``+ kl_coef * KL_t``.
* Entropy bonus: ``- entropy_coef * H_t``.

Each term is aggregated with the same per-token weights (``aggregation.token_weights``).

``policy_loss`` composes small pure functions, each usable (and tested) on its own:
``importance_ratio``, ``ppo_surrogate`` / ``cispo_surrogate``, ``truncated_importance_weight``
and ``loss_metrics``. They take tensors already zeroed at invalid positions (``policy_loss``
does that first, so NaN/inf in padding never reaches any arithmetic).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_rl.algorithms._checks import check_float, check_mask, check_same_shape
from megatron_rl.algorithms._cp import cp_world, masked_max, masked_min, sum_over_cp
from megatron_rl.algorithms.aggregation import token_weights
from megatron_rl.algorithms.config import PolicyLossConfig
from megatron_rl.algorithms.kl import kl_penalty
from megatron_rl.algorithms.normalization import StepNormalizer, compute_step_normalizer, sequence_lengths
from megatron_rl.algorithms.offpolicy import (ImportanceWeight, mismatch_metrics, off_policy_correction,
                                              truncated_importance_weight)

__all__ = [
    "policy_loss",
    "importance_ratio",
    "ppo_surrogate",
    "cispo_surrogate",
    "truncated_importance_weight",
    "loss_metrics",
    "Surrogate",
    "ImportanceWeight",
]


# ------------------------------------------------------------------------------------ the pieces
class Surrogate(NamedTuple):
    """Per-token policy-gradient term and where its clip binds (bool, valid tokens only)."""

    loss: torch.Tensor
    clip_low: torch.Tensor
    clip_high: torch.Tensor
    dual_active: torch.Tensor | None = None  # PPO with dual clip only


def importance_ratio(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    seq_len: torch.Tensor,
    ratio_level: str = "token",
    log_ratio_clamp: float | None = None,
    cp_group=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance ratio pi_theta / pi_old per token, at the token or the sequence level.

    * ``"token"`` (PPO, arXiv:1707.06347 Eq. 6): ``r_t = exp(logp_t - logp_old_t)``.
    * ``"sequence"`` (GSPO, arXiv:2507.18071 Eq. 7): ``s_i = exp(1/|o_i| sum_t (logp_t -
      logp_old_t))``, the length-normalized sequence ratio, broadcast to the sample's tokens;
      the gradient reaches every token through the mean.
    * ``"sequence_token"`` (GSPO-token, Eq. 13): ``exp(logp_t - sg(logp_t) + sg(log s_i))``:
      value s_i, d r / d logp_t = s_i.

    The log-ratio is clamped to ``[-log_ratio_clamp, log_ratio_clamp]`` before exp (None = no
    clamp). Inputs are ``[batch, seq]`` and zero at invalid positions; ``seq_len`` is ``[batch]``
    |o_i| over the whole sample (all CP slices); under CP the per-sample sum is all-reduced over
    ``cp_group`` (differentiably).

    Returns ``(ratio, token_log_ratio)``: the ratio used by the surrogate and the plain per-token
    ``logp - logp_old`` (for the k1 ``ppo_kl`` metric).
    """
    tok_log_ratio = logprobs - old_logprobs
    if ratio_level == "token":
        log_ratio = tok_log_ratio
    else:
        seq_sum = sum_over_cp(tok_log_ratio.sum(-1), cp_group, differentiable=True)
        seq_log_ratio = seq_sum / seq_len.clamp(min=1.0)
        if ratio_level == "sequence":
            log_ratio = seq_log_ratio.unsqueeze(-1).expand_as(logprobs)
        else:  # sequence_token: value s_i, gradient d/dlogp_t = s_i
            log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    return torch.exp(log_ratio), tok_log_ratio


def ppo_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = None,
) -> Surrogate:
    """PPO clipped surrogate loss per token (Schulman et al. 2017, arXiv:1707.06347 Eq. 7)::

        l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))

    with decoupled bounds (DAPO clip-higher, arXiv:2503.14476 §3.1) and, with ``dual_clip_c =
    c``, the dual clip of Ye et al. 2020 (arXiv:1912.09729 §4.2): ``l = min(l, -c A)`` where
    A < 0. The clip binds high where A > 0 and r > 1 + eps_high, low where A < 0 and
    r < 1 - eps_low; the dual clip where A < 0 and -c A < l.
    """
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(lo, hi)
    pg = torch.maximum(unclipped, clipped)
    clip_high = valid & (advantages > 0) & (ratio > hi)
    clip_low = valid & (advantages < 0) & (ratio < lo)
    dual_active = None
    if dual_clip_c is not None:
        cap = -advantages * dual_clip_c
        negative = advantages < 0
        dual_active = valid & negative & (cap < pg)
        pg = torch.where(negative, torch.minimum(pg, cap), pg)
    return Surrogate(pg, clip_low, clip_high, dual_active)


def cispo_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    valid: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> Surrogate:
    """CISPO loss per token (MiniMax-M1, arXiv:2506.13585 §3.1, Eq. 4)::

        l = -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi_theta

    The importance-sampling weight is clipped and detached; every token keeps its gradient
    (eps_low >= 1 means no lower bound, as in the paper). "Clipped" counts tokens whose weight
    was clipped, whatever the sign of A.
    """
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    weight = ratio.clamp(min=lo, max=hi).detach()
    pg = -weight * advantages * logprobs
    return Surrogate(pg, valid & (ratio < lo), valid & (ratio > hi))


def loss_metrics(
    valid: torch.Tensor,
    seq_len: torch.Tensor,
    nonfinite: torch.Tensor,
    *,
    loss: torch.Tensor,
    pg_loss: torch.Tensor,
    ratio: torch.Tensor,
    token_log_ratio: torch.Tensor,
    surrogate: Surrogate,
    kl: torch.Tensor | None = None,
    kl_loss: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    entropy_loss: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    cp_group=None,
) -> dict[str, torch.Tensor]:
    """The micro-batch's combinable metrics: detached 0-d float64 sums, maxima and minima.

    The key suffix says how each combines over micro-batches and ranks (``metrics.reduce_metrics``):
    ``/sum`` (losses, counts), ``/tok_sum`` (sum over valid tokens, a token mean once divided by
    ``count/tokens``), ``/sub_tok_sum`` (a token mean over a sub-population, divided by its own
    ``<parent>/tokens``), ``/max``, ``/min``. Always: ``count/tokens``, ``count/sequences`` (samples
    with a valid token, counted on CP rank 0 only), ``check/nonfinite_tokens``, ``actor/loss``,
    ``actor/pg_loss``, ``actor/clip_frac`` (``_low``, ``_high``), ``actor/ratio_mean`` / ``_max``
    / ``_min`` and ``actor/ppo_kl`` = mean of ``logp_old - logp`` (k1 estimate of
    KL(pi_old || pi), Schulman's approx_kl). With their inputs: ``actor/clip_frac_dual``,
    ``actor/kl`` / ``actor/kl_loss``, ``actor/entropy`` / ``actor/entropy_loss``. ``valid`` is
    the tokens the loss trains on (after the off-policy masks); the train/rollout mismatch and
    the importance weight's metrics (``mismatch/*``, ``tis/*``) are ``offpolicy.mismatch_metrics``,
    over the loss-mask tokens before those masks (``policy_loss`` adds them). With ``old_logprobs``
    (``policy_loss`` always passes them): ``actor/up_clipped/tokens`` (the count of valid tokens
    clipped at the upper bound, ``surrogate.clip_high``) and ``actor/up_clipped/old_prob``, the
    mean over those tokens of the OLD policy's probability ``exp(logp_old)`` (left out of the
    step values when no token was up-clipped). This is DAPO's clip-higher diagnostic
    (arXiv:2503.14476 §3.1, Fig. 3): the tokens the upper clip stops are mostly low-probability
    ones, so a small mean says eps_high is what holds exploration tokens back.
    """
    vf = valid.to(torch.float64)

    def tok_sum(x: torch.Tensor) -> torch.Tensor:
        return (x.detach().to(torch.float64) * vf).sum()

    def count(flags: torch.Tensor) -> torch.Tensor:
        return (flags & valid).sum().to(torch.float64)

    def d(x: torch.Tensor) -> torch.Tensor:
        return x.detach().to(torch.float64)

    # Under CP every rank sees every sample: count sequences on CP rank 0 only.
    cp_rank = dist.get_rank(cp_group) if cp_world(cp_group) > 1 else 0
    n_seqs = (seq_len > 0).sum().to(torch.float64) * (1.0 if cp_rank == 0 else 0.0)
    clip_low, clip_high = surrogate.clip_low, surrogate.clip_high
    metrics: dict[str, torch.Tensor] = {
        "count/tokens/sum": vf.sum(),
        "count/sequences/sum": n_seqs,
        "check/nonfinite_tokens/sum": nonfinite.sum().to(torch.float64),
        "actor/loss/sum": d(loss),
        "actor/pg_loss/sum": d(pg_loss),
        "actor/clip_frac/tok_sum": count(clip_low | clip_high),
        "actor/clip_frac_low/tok_sum": count(clip_low),
        "actor/clip_frac_high/tok_sum": count(clip_high),
        "actor/ratio_mean/tok_sum": tok_sum(ratio),
        "actor/ratio_max/max": masked_max(ratio, valid),
        "actor/ratio_min/min": masked_min(ratio, valid),
        "actor/ppo_kl/tok_sum": tok_sum(-token_log_ratio),  # k1 estimate of KL(pi_old || pi)
    }
    if surrogate.dual_active is not None:
        metrics["actor/clip_frac_dual/tok_sum"] = count(surrogate.dual_active)
    if kl is not None:
        metrics["actor/kl/tok_sum"] = tok_sum(kl)
        metrics["actor/kl_loss/sum"] = d(kl_loss)
    if entropy_loss is not None:
        metrics["actor/entropy/tok_sum"] = tok_sum(entropy)
        metrics["actor/entropy_loss/sum"] = d(entropy_loss)
    if old_logprobs is not None:
        # Always both keys (even at zero count): every rank must pass the same key set.
        up = clip_high & valid
        old_prob = torch.where(up, torch.exp(d(old_logprobs)), torch.zeros((), dtype=torch.float64, device=vf.device))
        metrics["actor/up_clipped/tokens/sum"] = up.sum().to(torch.float64)
        metrics["actor/up_clipped/old_prob/sub_tok_sum"] = old_prob.sum()
    return metrics


# ------------------------------------------------------------------------------------ checks
_OPTIONAL = ("ref_logprobs", "rollout_logprobs", "entropy")


def _check_inputs(logprobs, old_logprobs, advantages, mask, optional: dict, cfg: PolicyLossConfig) -> torch.Tensor:
    """Shapes, dtypes and the inputs the config needs; returns the bool mask."""
    check_float(logprobs, "logprobs", dim=2)
    check_float(old_logprobs, "old_logprobs")
    check_same_shape(old_logprobs, logprobs, "old_logprobs", "logprobs")
    m = check_mask(mask)
    check_same_shape(m, logprobs, "mask", "logprobs")
    check_float(advantages, "advantages", dim=(1, 2))
    batch = logprobs.shape[0]
    if advantages.dim() == 1 and advantages.shape[0] != batch:
        raise ValueError(f"per-sample advantages have {advantages.shape[0]} entries but logprobs has {batch} rows")
    if advantages.dim() == 2:
        check_same_shape(advantages, logprobs, "advantages", "logprobs")
    for name, t in optional.items():
        if t is not None:
            check_float(t, name)
            check_same_shape(t, logprobs, name, "logprobs")
    if cfg.kl_coef > 0 and optional["ref_logprobs"] is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} > 0 needs ref_logprobs")
    if cfg.entropy_coef != 0 and optional["entropy"] is None:
        raise ValueError(f"entropy_coef={cfg.entropy_coef} != 0 needs entropy")
    if cfg.tis_level is not None and optional["rollout_logprobs"] is None:
        raise ValueError(f"tis_level={cfg.tis_level!r} needs rollout_logprobs")
    if cfg.opsm_delta is not None and optional["rollout_logprobs"] is None:
        raise ValueError(f"opsm_delta={cfg.opsm_delta} needs rollout_logprobs (the sampling policy's logprobs)")
    return m


def _check_normalizer(normalizer, m: torch.Tensor, cfg: PolicyLossConfig, cp_group) -> StepNormalizer:
    if normalizer is None:
        normalizer = compute_step_normalizer([m], cfg.loss_agg_mode, cfg.l_norm, group=cp_group, cp_group=cp_group)
    elif not isinstance(normalizer, StepNormalizer):
        raise ValueError(f"normalizer must be a StepNormalizer or None, got {type(normalizer).__name__}")
    if normalizer.loss_agg_mode != cfg.loss_agg_mode:
        raise ValueError(
            f"normalizer was computed for loss_agg_mode={normalizer.loss_agg_mode!r} but the config "
            f"uses {cfg.loss_agg_mode!r}"
        )
    if cfg.l_norm is not None and normalizer.l_norm != cfg.l_norm:
        raise ValueError(f"normalizer.l_norm={normalizer.l_norm} differs from config l_norm={cfg.l_norm}")
    return normalizer


def _valid_tokens(named: dict[str, torch.Tensor], m: torch.Tensor, on_nonfinite: str, cp_group,
                  dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(valid, nonfinite, seq_len, finite)``: the tokens that enter the loss (``"mask"``: those
    with a NaN/inf in any input leave it, denominators unchanged; ``"raise"``: all of ``m``,
    checked by ``_raise_on_bad``), the valid tokens with a NaN/inf, |o_i| over the full mask (all
    CP slices) and each input's finite flags. No host sync."""
    finite = {k: torch.isfinite(v.detach()) for k, v in named.items()}
    bad_any = m & ~torch.stack(list(finite.values())).all(0)
    seq_len = sequence_lengths(m, cp_group).to(dt)
    valid = m if on_nonfinite == "raise" else m & ~bad_any
    return valid, bad_any, seq_len, finite


def _raise_on_bad(finite: dict[str, torch.Tensor], m: torch.Tensor, kept: torch.Tensor, kept_len: torch.Tensor,
                  normalizer: StepNormalizer) -> None:
    """``on_nonfinite="raise"``, in one host sync: a ValueError naming each input's count of
    NaN/inf at valid tokens, or a normalizer that cannot contain this micro-batch's tokens that
    stay in the loss (after the off-policy masks)."""
    counts = torch.stack([(m & ~f).sum() for f in finite.values()] + [kept.sum(), (kept_len > 0).sum()]).tolist()
    bad = {k: int(c) for k, c in zip(finite, counts) if c}
    if bad:
        detail = ", ".join(f"{k}: {c}" for k, c in bad.items())
        raise ValueError(f"non-finite values (NaN/inf) at valid tokens: {detail}")
    if counts[-2] > normalizer.num_tokens or counts[-1] > normalizer.num_sequences:
        raise ValueError(
            f"this micro-batch has {int(counts[-2])} tokens / {int(counts[-1])} sequences but the "
            f"normalizer counts {normalizer.num_tokens:g} / {normalizer.num_sequences:g} for the whole "
            f"step: it was computed from other masks (with off-policy masks: from off_policy_keep's)"
        )


# ------------------------------------------------------------------------------------ the loss
def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig | None = None,
    *,
    normalizer: StepNormalizer | None = None,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    opsm_logprobs: torch.Tensor | None = None,
    cp_group=None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch (its share of the step loss) and its combinable metrics.

    Per valid token: ``l_t = w_t * surrogate(r_t, A) + kl_coef * KL_t - entropy_coef * H_t``
    (``importance_ratio``, ``ppo_surrogate`` / ``cispo_surrogate``,
    ``truncated_importance_weight``; w_t = 1 without TIS), summed with the step's per-token
    weights of ``loss_agg_mode``.

    Asynchronous RL: with rollouts from a policy up to k >= 1 versions older than the one being
    updated (``rl.max_staleness``), token-level truncated importance sampling IS the decoupled
    PPO objective of AReaL (Fu et al. 2025, arXiv:2505.24298 Eq. 5)::

        l_t = -min(pi_prox/pi_behav, C) * min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A),
        r_t = pi_theta / pi_prox

    where the proximal policy pi_prox is ``old_logprobs`` (the trainer's own logprobs at the
    step's start, the policy the clip trusts) and the behaviour policy pi_behav is
    ``rollout_logprobs`` (the engine's per-token logprobs, of whichever version sampled each
    token), with C = ``tis_upper``. The same weight also corrects the train/inference mismatch
    of a synchronous run (k = 0).

    Args:
        logprobs: ``[batch, seq]`` log pi_theta of the sampled tokens (differentiable).
        old_logprobs: ``[batch, seq]`` log pi_old (the policy that the ratio is taken against;
            on-policy: ``logprobs.detach()``). Treated as a constant.
        advantages: ``[batch]`` per-sample or ``[batch, seq]`` per-token advantages (constant).
        mask: ``[batch, seq]`` bool or 0/1, True on response tokens that enter the loss. Rows
            are whole samples: a sample is never split across micro-batches (under context
            parallelism, across CP ranks only, with ``cp_group`` given).
        config: ``PolicyLossConfig`` (None = defaults).
        normalizer: the step's ``StepNormalizer`` from ``compute_step_normalizer`` over every
            micro-batch and rank of the step. With off-policy masks (``config.masks_tokens``) it must
            count the masks ``offpolicy.off_policy_keep`` returns (masked tokens leave it). None = this call is the whole step (counts from
            ``mask``, communication only over ``cp_group``).
        ref_logprobs: ``[batch, seq]`` reference-policy logprobs (needed when kl_coef > 0; if
            given with kl_coef == 0 the KL is only reported).
        rollout_logprobs: ``[batch, seq]`` logprobs reported by the rollout engine (needed for
            TIS; if given, train/rollout mismatch metrics are reported either way).
        entropy: ``[batch, seq]`` per-token entropy (needed when entropy_coef != 0; reported if
            given). Differentiable.
        opsm_logprobs: ``[batch, seq]`` pi_theta for DeepSeek-V3.2's sequence mask
            (``opsm_delta``): the logprobs of the policy being updated, at the update's start, the
            same tensor given to ``off_policy_keep`` for the normaliser. None = ``logprobs``
            (detached), which is the same policy when this call is the whole step.
        cp_group: context-parallel group when each CP rank holds a slice of every sample's
            tokens; per-sample sums (lengths, GSPO log-ratio, sequence TIS) are all-reduced
            over it. None = samples are whole on this rank.

    Returns:
        ``(loss, metrics)``: ``loss`` is a 0-d tensor in float32 (float64 if ``logprobs`` is
        float64), differentiable w.r.t. ``logprobs`` (and ``entropy``); sum it over
        micro-batches and ranks, with no further scaling. ``metrics`` maps names to detached
        0-d float64 tensors that are sums / maxima / minima over this micro-batch (the key
        suffix says which, see ``metrics.reduce_metrics`` and ``loss_metrics``); combine a
        step's dicts with ``reduce_metrics(list_of_dicts, group=dp_group)``.

    Raises:
        ValueError: on bad shapes/dtypes/masks, a normalizer for another ``loss_agg_mode``, a
            missing input the config needs, or (``on_nonfinite="raise"``) NaN/inf at a valid
            token of any input, naming the tensor and the count.
    """
    cfg = PolicyLossConfig() if config is None else config
    if not isinstance(cfg, PolicyLossConfig):
        raise ValueError(f"config must be a PolicyLossConfig, got {type(cfg).__name__}")
    optional = {"ref_logprobs": ref_logprobs, "rollout_logprobs": rollout_logprobs, "entropy": entropy}
    m = _check_inputs(logprobs, old_logprobs, advantages, mask, optional, cfg)
    if opsm_logprobs is not None:
        check_float(opsm_logprobs, "opsm_logprobs")
        check_same_shape(opsm_logprobs, logprobs, "opsm_logprobs", "logprobs")

    # Inputs in the compute dtype; only logprobs and entropy carry gradients.
    dt = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
    lp = logprobs.to(dt)
    old = old_logprobs.detach().to(dt)
    adv = advantages.detach().to(dt)
    adv = adv.unsqueeze(-1).expand_as(lp) if adv.dim() == 1 else adv
    extra = {k: (v.to(dt) if k == "entropy" else v.detach().to(dt)) for k, v in optional.items() if v is not None}
    named = {"logprobs": lp, "old_logprobs": old, "advantages": adv, **extra}
    valid, bad_any, seq_len, finite = _valid_tokens(named, m, cfg.on_nonfinite, cp_group, dt)
    zero = torch.zeros((), dtype=dt, device=logprobs.device)

    def clean(x: torch.Tensor, where: torch.Tensor = valid) -> torch.Tensor:
        # Zero every position outside the loss BEFORE any arithmetic: NaN/inf in padding must
        # neither reach the loss nor the gradient (where() sends zero gradient to the unselected side).
        return torch.where(where, x, zero)

    lp_c, old_c, adv_c = clean(lp), clean(old), clean(adv)
    roll_c = clean(extra["rollout_logprobs"]) if rollout_logprobs is not None else None
    # Off-policy corrections against the engine's logprobs: an importance weight, and the tokens
    # that leave the loss (kept: what stays; its per-sample length and the normaliser follow).
    theta = clean(opsm_logprobs.detach().to(dt)) if opsm_logprobs is not None else lp_c.detach()
    corr = off_policy_correction(cfg, valid, old_c, roll_c, adv_c, theta, seq_len, cp_group)
    kept, kept_len = valid, seq_len
    if corr is not None and cfg.masks_tokens:
        kept = corr.keep
        kept_len = seq_len - sum_over_cp((valid & ~kept).sum(-1).to(dt), cp_group, differentiable=False)
        lp_c, old_c, adv_c = clean(lp_c, kept), clean(old_c, kept), clean(adv_c, kept)
    normalizer = _check_normalizer(normalizer, m & (kept | ~valid), cfg, cp_group)
    if cfg.on_nonfinite == "raise":
        _raise_on_bad(finite, m, kept, kept_len, normalizer)

    ratio, tok_log_ratio = importance_ratio(lp_c, old_c, kept_len, cfg.ratio_level, cfg.log_ratio_clamp, cp_group)
    if cfg.policy_loss_type == "ppo":
        sur = ppo_surrogate(ratio, adv_c, kept, cfg.eps_low, cfg.eps_high, cfg.dual_clip_c)
    else:
        sur = cispo_surrogate(ratio, adv_c, lp_c, kept, cfg.eps_low, cfg.eps_high)
    pg = sur.loss
    if corr is not None and corr.tis is not None:
        pg = pg * corr.tis.weight.to(dt)

    # Aggregation and regularizers, all with the same per-token weights (zero off the kept tokens).
    weights = token_weights(kept, kept_len, normalizer, dt)
    pg_loss = (pg * weights).sum()
    loss = pg_loss
    kl_tok = kl_loss = ent_c = ent_loss = None
    if ref_logprobs is not None:
        kl_tok = kl_penalty(lp_c, clean(extra["ref_logprobs"], kept), cfg.kl_loss_type,
                            input_clamp=cfg.kl_input_clamp, output_clamp=cfg.kl_output_clamp)
        kl_loss = (kl_tok * weights).sum()
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl_loss
    if entropy is not None:
        ent_c = clean(extra["entropy"], kept)
        ent_loss = (ent_c * weights).sum()
        if cfg.entropy_coef != 0:
            loss = loss - cfg.entropy_coef * ent_loss

    metrics = loss_metrics(kept, kept_len, bad_any, loss=loss, pg_loss=pg_loss, ratio=ratio,
                           token_log_ratio=tok_log_ratio, surrogate=sur, kl=kl_tok, kl_loss=kl_loss,
                           entropy=ent_c, entropy_loss=ent_loss, old_logprobs=old_c, cp_group=cp_group)
    if roll_c is not None:
        metrics.update(mismatch_metrics(valid, seq_len, clean(old) - roll_c, corr, cp_group))
    return loss, metrics
