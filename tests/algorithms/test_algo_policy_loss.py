"""policy_loss: autograd gradients equal the papers' closed forms, the seed walkthrough's gradient
mass, clip / TIS / mismatch metrics on constructed tokens, degenerate inputs and errors."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms import (PolicyLossConfig, StepNormalizer, compute_advantages, compute_step_normalizer,
                                    policy_loss, recipe, reduce_metrics)

SEED_REWARDS = torch.tensor([[1.1, 0.1, 0.0, 1.1]], dtype=torch.float64)
SEED_LENGTHS = [220, 950, 1100, 180]


def seed_batch(noise=0.0, seed=0):
    t = max(SEED_LENGTHS)
    mask = torch.zeros(4, t, dtype=torch.bool)
    for i, n in enumerate(SEED_LENGTHS):
        mask[i, :n] = True
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, t, generator=g, dtype=torch.float64) - 0.1
    lp = old + noise * torch.randn(4, t, generator=g, dtype=torch.float64)
    return lp, old, mask


def grad_of(cfg, lp, old, adv, mask, **kw):
    x = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(x, old, adv, mask, cfg, **kw)
    loss.backward()
    return loss.detach(), x.grad, metrics


def expected(mask, per_sample):
    return per_sample.unsqueeze(1) * mask.to(torch.float64)


# ----------------------------------------------------------------------------- closed forms
def test_grpo_closed_form_weight():
    lp, old, mask = seed_batch()
    rc = recipe("grpo")  # seq-mean-token-mean, KL k3 beta 0.04
    adv = compute_advantages(SEED_REWARDS, rc.advantage_estimator, std="population")[0]
    # At pi = pi_old = pi_ref the k3 gradient is 0, so only the surrogate remains.
    _, g, _ = grad_of(rc.loss, old, old, adv, mask, ref_logprobs=old)
    lens = mask.sum(1).double()
    torch.testing.assert_close(g, expected(mask, -adv / lens / 4), rtol=1e-12, atol=0)  # A_i / |o_i| / G


def test_dr_grpo_closed_form_weight():
    lp, old, mask = seed_batch()
    rc = recipe("dr_grpo")
    adv = compute_advantages(SEED_REWARDS, rc.advantage_estimator)[0]
    _, g, _ = grad_of(rc.loss, old, old, adv, mask)
    torch.testing.assert_close(g, expected(mask, -adv / (4 * 1100)), rtol=1e-12, atol=0)  # L_norm = longest
    rc = recipe("dr_grpo", l_norm=4096)  # the paper's constant: the generation budget
    _, g, _ = grad_of(rc.loss, old, old, adv, mask)
    torch.testing.assert_close(g, expected(mask, -adv / (4 * 4096)), rtol=1e-12, atol=0)


def test_dapo_closed_form_weight():
    lp, old, mask = seed_batch()
    rc = recipe("dapo")
    adv = compute_advantages(SEED_REWARDS, rc.advantage_estimator, std="population")[0]
    _, g, _ = grad_of(rc.loss, old, old, adv, mask)
    torch.testing.assert_close(g, expected(mask, -adv / sum(SEED_LENGTHS)), rtol=1e-12, atol=0)  # A_i / sum |o_j|


def test_gspo_closed_form_weight():
    lp, old, mask = seed_batch(noise=0.05)
    adv = compute_advantages(SEED_REWARDS, "grpo", std="population")[0]
    lens = mask.sum(1).double()
    s = torch.exp(((lp - old) * mask).sum(1) / lens)  # sequence ratio (geometric mean of token ratios)
    assert (s - 1).abs().max() > 1e-3  # really off-policy
    for level in ("sequence", "sequence_token"):  # identical with per-sample advantages
        cfg = recipe("gspo", eps_low=0.5, eps_high=0.5).loss.replace(ratio_level=level)  # unclipped
        loss, g, m = grad_of(cfg, lp, old, adv, mask)
        torch.testing.assert_close(g, expected(mask, -s * adv / lens / 4), rtol=1e-12, atol=0)  # s_i A_i / |o_i| / G
        assert abs(loss.item() - (-(s * adv).sum() / 4).item()) < 1e-12
        assert m["actor/clip_frac/tok_sum"] == 0
    # The recipe's tiny clip range (3e-4 / 4e-4) clips these sequences: gradient only where the
    # clip does not bind (A > 0 with s < 1 + eps_high, or A < 0 with s > 1 - eps_low).
    _, g, m = grad_of(recipe("gspo").loss, lp, old, adv, mask)
    active = ((adv > 0) & (s < 1 + 4e-4)) | ((adv < 0) & (s > 1 - 3e-4))
    torch.testing.assert_close(g, expected(mask, torch.where(active, -s * adv / lens / 4, 0.0)), rtol=1e-12, atol=0)
    assert m["actor/clip_frac/tok_sum"] > 0


def test_gspo_sequence_vs_sequence_token_with_per_token_advantages():
    """GSPO-token (Eq. 13) gives token t the weight s_i A_{i,t}; plain GSPO spreads the sample's
    total advantage through the mean: s_i / |o_i| * sum_u A_{i,u}."""
    lp, old, mask = seed_batch(noise=0.05)
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(4, 1100, generator=g, dtype=torch.float64)
    lens = mask.sum(1).double()
    s = torch.exp(((lp - old) * mask).sum(1) / lens)
    base = PolicyLossConfig(eps_low=5.0, eps_high=5.0, loss_agg_mode="seq-mean-token-mean")
    _, g_tok, _ = grad_of(base.replace(ratio_level="sequence_token"), lp, old, adv, mask)
    torch.testing.assert_close(g_tok, -(s / lens / 4).unsqueeze(1) * adv * mask, rtol=1e-12, atol=1e-18)
    _, g_seq, _ = grad_of(base.replace(ratio_level="sequence"), lp, old, adv, mask)
    total_adv = (adv * mask).sum(1)
    torch.testing.assert_close(g_seq, expected(mask, -s / lens * total_adv / lens / 4), rtol=1e-12, atol=1e-18)


def test_cispo_keeps_gradient_of_clipped_tokens():
    old = torch.full((1, 4), -1.0, dtype=torch.float64)
    lp = old + torch.tensor([[0.0, 0.5, -0.5, 0.1]], dtype=torch.float64)  # ratios 1, 1.65, 0.61, 1.11
    adv = torch.tensor([1.0], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    r = torch.exp(lp - old)[0]
    _, g, m = grad_of(recipe("cispo").loss, lp, old, adv, mask)  # eps_low 1 (no lower bound), eps_high 0.28
    torch.testing.assert_close(g[0], -r.clamp(max=1.28) / 4, rtol=1e-12, atol=0)  # sg(clip(r)) A / N, never 0
    assert m["actor/clip_frac_high/tok_sum"] == 1
    _, g_ppo, _ = grad_of(PolicyLossConfig(eps_high=0.28), lp, old, adv, mask)
    assert g_ppo[0, 1] == 0 and g[0, 1] != 0  # PPO drops the clipped token, CISPO keeps it


# ----------------------------------------------------------------------------- seed walkthrough
def test_seed_walkthrough_gradient_mass():
    """GRPO gives every rollout the same weight mass 1/G = 25% (so gradient mass ~ |A_i|, length
    independent); token-level aggregation gives mass in proportion to |A_i| * L_i."""
    lp, old, mask = seed_batch()
    adv = compute_advantages(SEED_REWARDS, "grpo", std="population")[0]
    lens = torch.tensor(SEED_LENGTHS, dtype=torch.float64)
    _, g, _ = grad_of(recipe("grpo", kl_coef=0.0).loss, old, old, adv, mask)
    mass = g.abs().sum(1)
    torch.testing.assert_close(mass / adv.abs(), torch.full((4,), 0.25, dtype=torch.float64), rtol=1e-12, atol=0)
    share = mass / mass.sum()
    torch.testing.assert_close(share, adv.abs() / adv.abs().sum(), rtol=1e-12, atol=0)
    torch.testing.assert_close(share, torch.tensor([0.25, 0.226, 0.274, 0.25], dtype=torch.float64), atol=1e-3, rtol=0)
    for name in ("dapo", "dr_grpo"):
        rc = recipe(name)
        a = compute_advantages(SEED_REWARDS, rc.advantage_estimator, std="population")[0]
        _, g, _ = grad_of(rc.loss, old, old, a, mask)
        mass = g.abs().sum(1)
        want = a.abs() * lens / (a.abs() * lens).sum()
        torch.testing.assert_close(mass / mass.sum(), want, rtol=1e-12, atol=0)
        torch.testing.assert_close(mass / mass.sum(), torch.tensor([0.089, 0.349, 0.489, 0.073], dtype=torch.float64),
                                   atol=1e-3, rtol=0)
    # per-token pulls of the seed table (GRPO column A_i / L_i, before the 1/G), to its printed
    # precision (the table rounds 0.998 / 180 = 0.005544 up to 0.00555)
    _, g, _ = grad_of(recipe("grpo", kl_coef=0.0).loss, old, old, adv, mask)
    torch.testing.assert_close(-4 * g[:, 0], torch.tensor([0.00454, -0.00095, -0.00099, 0.00555], dtype=torch.float64),
                               atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- metrics on constructed tokens
def test_clip_fractions_ratio_stats_and_dual_clip():
    old = torch.zeros(2, 4, dtype=torch.float64)
    ratios = torch.tensor([[1.0, 1.5, 0.5, 4.0], [1.1, 0.7, 1.3, 1.0]], dtype=torch.float64)
    lp = ratios.log()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0], [-1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)  # per token
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    cfg = PolicyLossConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, loss_agg_mode="token-sum")
    loss, g, m = grad_of(cfg, lp, old, adv, mask)
    out = reduce_metrics([m])
    # high: A>0 & r>1.28 -> (0,1), (1,2); low: A<0 & r<0.8 -> (0,2); dual: A<0 & r>3 -> (0,3)
    assert out["actor/clip_frac_high"] == pytest.approx(2 / 7)
    assert out["actor/clip_frac_low"] == pytest.approx(1 / 7)
    assert out["actor/clip_frac"] == pytest.approx(3 / 7)
    assert out["actor/clip_frac_dual"] == pytest.approx(1 / 7)
    assert out["actor/ratio_max"] == pytest.approx(4.0) and out["actor/ratio_min"] == pytest.approx(0.5)
    assert out["actor/ratio_mean"] == pytest.approx(float(ratios[mask].mean()))
    # per-token loss: -A r unclipped, clipped constant, dual-clipped -A c
    want = (-1.0) + (-1.28) + 0.8 + 3.0 + 1.1 + (-0.7) + (-1.28)
    assert loss.item() == pytest.approx(want)
    # gradient d/dlogp = -A r where unclipped, 0 where a clip binds (and at padding)
    want_g = torch.tensor([[-1.0, 0.0, 0.0, 0.0], [1.1, -0.7, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(g, want_g, rtol=1e-12, atol=1e-15)


def _up_clipped_oracle(old_probs, ratios, adv, mask, eps_high):
    """Float64 re-derivation, token by token in plain Python: (count, mean of pi_old) over the
    valid tokens with A > 0 and r > 1 + eps_high (where PPO's upper clip binds)."""
    picked = [p for row_p, row_r, row_a, row_m in zip(old_probs, ratios, adv, mask)
              for p, r, a, m in zip(row_p, row_r, row_a, row_m) if m and a > 0 and r > 1.0 + eps_high]
    return len(picked), (math.fsum(picked) / len(picked) if picked else None)


def test_up_clipped_old_probability():
    """DAPO's clip-higher diagnostic (arXiv:2503.14476 §3.1): the mean OLD-policy probability of
    the tokens clipped at the upper bound, against a plain-Python float64 re-derivation."""
    old_probs = [[0.05, 0.5, 0.1, 0.9, 0.02], [0.3, 0.02, 0.6, 0.2, 0.7], [0.15, 0.4, 0.8, 0.01, 0.5]]
    ratios = [[3.0, 1.5, 1.1, 1.05, 5.0], [1.4, 9.0, 0.5, 2.0, 1.0], [1.0, 1.2, 0.9, 20.0, 1.3]]
    adv = [[1.0, 1.0, 1.0, 1.0, 1.0], [-1.0, 0.5, 1.0, 2.0, 1.0], [1.0, 1.0, -1.0, -1.0, 1.0]]
    # (0, 4) and (2, 4) are padding with r > 1.28 and A > 0: they must not count
    mask = [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    old = torch.tensor(old_probs, dtype=torch.float64).log()
    lp = old + torch.tensor(ratios, dtype=torch.float64).log()  # pi_new = r * pi_old != pi_old
    adv_t, mask_t = torch.tensor(adv, dtype=torch.float64), torch.tensor(mask, dtype=torch.bool)
    cfg = PolicyLossConfig(eps_low=0.2, eps_high=0.28, loss_agg_mode="token-mean")
    _, m = policy_loss(lp, old, adv_t, mask_t, cfg)
    n_want, mean_want = _up_clipped_oracle(old_probs, ratios, adv, mask, 0.28)
    # (0,0) (0,1) (1,1) (1,3); not (1,0) / (2,3) with A < 0, (0,4) / (2,4) padding, (0,2) r < 1.28
    assert n_want == 4
    out = reduce_metrics([m])
    assert out["actor/up_clipped/tokens"] == n_want
    assert out["actor/up_clipped/tokens"] == out["actor/clip_frac_high"] * out["count/tokens"]
    assert out["actor/up_clipped/old_prob"] == pytest.approx(mean_want, rel=1e-12, abs=0)
    # The same step split into micro-batches (the second has no up-clipped token) combines exactly.
    parts = [policy_loss(lp[rows], old[rows], adv_t[rows], mask_t[rows], cfg,
                         normalizer=compute_step_normalizer([mask_t], cfg.loss_agg_mode))[1]
             for rows in (slice(0, 2), slice(2, 3))]
    assert parts[1]["actor/up_clipped/tokens/sum"] == 0
    split = reduce_metrics(parts)
    assert split["actor/up_clipped/tokens"] == n_want
    assert split["actor/up_clipped/old_prob"] == pytest.approx(mean_want, rel=1e-12, abs=0)
    # No up-clipped token: both keys still in the micro-batch dict (same key set on every rank),
    # zero count, and the mean is left out of the step values (never NaN).
    _, m0 = policy_loss(old, old, adv_t, mask_t, cfg)  # r = 1 everywhere
    assert m0["actor/up_clipped/tokens/sum"] == 0 and m0["actor/up_clipped/old_prob/sub_tok_sum"] == 0
    out0 = reduce_metrics([m0])
    assert out0["actor/up_clipped/tokens"] == 0 and "actor/up_clipped/old_prob" not in out0


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_truncated_importance_sampling_and_mismatch_metrics(level, mode):
    old = torch.zeros(2, 3, dtype=torch.float64)
    lp = old.clone()
    rollout = torch.tensor([[0.0, -1.0, 0.5], [0.2, 0.0, 0.0]], dtype=torch.float64)  # w = exp(old - rollout)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    cfg = PolicyLossConfig(tis_level=level, tis_mode=mode, tis_upper=2.0, tis_lower=0.7 if mode == "mask" else None,
                           loss_agg_mode="token-sum")
    loss, g, m = grad_of(cfg, lp, old, adv, mask, rollout_logprobs=rollout)
    lw = (old - rollout)
    if level == "sequence":
        lw = (lw * mask).sum(1, keepdim=True).expand(2, 3)  # log of the product over the sample
    w = lw.exp()
    if mode == "truncate":
        w_used = w.clamp(max=2.0)
    else:
        w_used = torch.where((w >= 0.7) & (w <= 2.0), w, 0.0)
    torch.testing.assert_close(g, -(adv.unsqueeze(1) * w_used) * mask, rtol=1e-12, atol=0)
    out = reduce_metrics([m])
    assert out["tis/weight_mean"] == pytest.approx(float(w_used[mask].mean()))
    assert out["tis/weight_max"] == pytest.approx(float(w_used[mask].max()))
    assert out["tis/weight_min"] == pytest.approx(float(w_used[mask].min()))
    outside = ((w > 2.0) | (w < (0.7 if mode == "mask" else 0.0)))[mask].double().mean().item()
    assert out["tis/masked_frac" if mode == "mask" else "tis/truncated_frac"] == pytest.approx(outside)
    assert out["tis/truncated_frac" if mode == "mask" else "tis/masked_frac"] == 0
    diff = (old - rollout)[mask].abs()
    assert out["mismatch/logp_abs_diff_mean"] == pytest.approx(float(diff.mean()))
    assert out["mismatch/logp_abs_diff_max"] == pytest.approx(1.0)
    d = (old - rollout)[mask]
    assert out["mismatch/kl"] == pytest.approx(float((d.exp() - 1 - d).mean()))


def test_kl_entropy_terms_and_metrics():
    g0 = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 5, generator=g0, dtype=torch.float64)
    ref = lp + 0.1 * torch.randn(3, 5, generator=g0, dtype=torch.float64)
    ent = torch.rand(3, 5, generator=g0, dtype=torch.float64).requires_grad_(True)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, 3:] = False
    cfg = PolicyLossConfig(kl_coef=0.1, kl_loss_type="low_var_kl", entropy_coef=0.01)
    x = lp.clone().requires_grad_(True)
    loss, m = policy_loss(x, lp, torch.zeros(3, dtype=torch.float64), mask, cfg, ref_logprobs=ref, entropy=ent)
    loss.backward()
    n = mask.sum().item()
    xk = (lp - ref)
    torch.testing.assert_close(x.grad, 0.1 * (1 - torch.exp(-xk)) * mask / n, rtol=1e-12, atol=1e-18)
    torch.testing.assert_close(ent.grad, -0.01 * mask.double() / n, rtol=1e-12, atol=0)
    out = reduce_metrics([m])
    assert out["actor/kl"] == pytest.approx(float((torch.exp(-xk) - 1 + xk)[mask].mean()))
    assert out["actor/entropy"] == pytest.approx(float(ent.detach()[mask].mean()))
    assert out["actor/loss"] == pytest.approx(0.1 * out["actor/kl"] - 0.01 * out["actor/entropy"])
    # ref given with kl_coef 0: reported, not in the loss
    loss0, m0 = policy_loss(lp, lp, torch.zeros(3, dtype=torch.float64), mask, PolicyLossConfig(), ref_logprobs=ref)
    assert loss0.item() == 0 and reduce_metrics([m0])["actor/kl"] == pytest.approx(out["actor/kl"])


# ----------------------------------------------------------------------------- degenerate inputs
def test_all_equal_rewards_zero_gradient_no_nan():
    lp, old, mask = seed_batch(noise=0.1)
    adv = compute_advantages(torch.ones(1, 4), "grpo")[0].double()
    for name in ("grpo", "dr_grpo", "dapo", "gspo", "cispo"):
        rc = recipe(name, kl_coef=0.0)
        loss, g, m = grad_of(rc.loss, lp, old, adv, mask)
        assert loss.item() == 0 and torch.count_nonzero(g) == 0, name
        assert all(math.isfinite(v) for v in reduce_metrics([m]).values()), name


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm", "token-sum"])
@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
def test_empty_mask_and_single_token(mode, level):
    cfg = PolicyLossConfig(loss_agg_mode=mode, ratio_level=level, kl_coef=0.1, tis_level="sequence")
    nan = torch.full((2, 3), float("nan"), dtype=torch.float64)  # padding may hold anything
    empty = torch.zeros(2, 3, dtype=torch.bool)
    loss, g, m = grad_of(cfg, nan, nan, torch.ones(2, dtype=torch.float64), empty, ref_logprobs=nan,
                         rollout_logprobs=nan)
    assert loss.item() == 0 and torch.count_nonzero(g) == 0 and torch.isfinite(g).all()
    out = reduce_metrics([m])
    assert out["count/tokens"] == 0 and "actor/ratio_mean" not in out and "actor/ratio_max" not in out
    assert all(math.isfinite(v) for v in out.values())
    # Same with a zero-row micro-batch (a rank or filler micro-batch without samples).
    z = torch.zeros(0, 0, dtype=torch.float64)
    loss, g, _ = grad_of(cfg, z, z, torch.zeros(0, dtype=torch.float64), z.bool(), ref_logprobs=z, rollout_logprobs=z)
    assert loss.item() == 0 and g.shape == (0, 0)
    # A single-token sample: every mode reduces to the single token's PPO term.
    one = torch.tensor([[True, False, False]])
    lp = torch.tensor([[-0.5, 0.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[-0.6, 0.0, 0.0]], dtype=torch.float64)
    loss, g, _ = grad_of(cfg.replace(kl_coef=0.0, tis_level=None), lp, old, torch.tensor([2.0], dtype=torch.float64), one)
    r = math.exp(0.1)  # one token, one sample, L_norm = the longest sample = 1: every weight is 1
    assert loss.item() == pytest.approx(-2.0 * min(r, 1.2))
    assert g[0, 0].item() == pytest.approx(-2.0 * r if r < 1.2 else 0.0) and g[0, 1:].abs().sum() == 0


def test_nonfinite_inputs_detected_and_reported():
    lp, old, mask = seed_batch(noise=0.1)
    adv = compute_advantages(SEED_REWARDS, "grpo")[0]
    bad = lp.clone()
    bad[1, 5] = float("nan")
    bad[2, 7] = float("inf")
    with pytest.raises(ValueError, match=r"non-finite.*logprobs: 2"):
        policy_loss(bad, old, adv, mask, PolicyLossConfig())
    bad_old = old.clone()
    bad_old[0, 0] = float("-inf")
    with pytest.raises(ValueError, match=r"old_logprobs: 1"):
        policy_loss(lp, bad_old, adv, mask, PolicyLossConfig())
    with pytest.raises(ValueError, match=r"advantages: 220"):  # a NaN per-sample advantage hits all 220 tokens
        policy_loss(lp, old, torch.tensor([float("nan"), 0.0, 0.0, 0.0], dtype=torch.float64), mask, PolicyLossConfig())
    bad_ref = lp.clone()
    bad_ref[3, 0] = float("nan")
    with pytest.raises(ValueError, match=r"ref_logprobs: 1"):
        policy_loss(lp, old, adv, mask, PolicyLossConfig(kl_coef=0.1), ref_logprobs=bad_ref)
    # mask mode: the bad tokens drop out of the loss, the rest is unchanged, the count is reported
    cfg = PolicyLossConfig(on_nonfinite="mask", loss_agg_mode="seq-mean-token-mean")
    loss, g, m = grad_of(cfg, bad, old, adv, mask)
    assert torch.isfinite(g).all() and torch.isfinite(loss)
    assert reduce_metrics([m])["check/nonfinite_tokens"] == 2
    clean_mask = mask.clone()
    clean_mask[1, 5] = clean_mask[2, 7] = False
    norm = compute_step_normalizer([mask], cfg.loss_agg_mode)  # denominators of the original step
    x = lp.clone().requires_grad_(True)
    # same as zero-weighting those two tokens with the ORIGINAL |o_i|: compare token by token
    loss_ref, _ = policy_loss(x, old, adv, mask, cfg.replace(on_nonfinite="raise"), normalizer=norm)
    loss_ref.backward()
    torch.testing.assert_close(g, x.grad * clean_mask, rtol=1e-12, atol=0)


def test_low_precision_inputs_compute_in_fp32():
    lp, old, mask = seed_batch(noise=0.05)
    adv = compute_advantages(SEED_REWARDS, "grpo")[0]
    x = lp.to(torch.bfloat16).requires_grad_(True)
    loss, _ = policy_loss(x, old.to(torch.bfloat16), adv.float(), mask, recipe("dapo").loss)
    assert loss.dtype == torch.float32
    loss.backward()
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad.float()).all()


# ----------------------------------------------------------------------------- errors
def test_errors_name_the_bad_value():
    lp = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    adv = torch.zeros(2)
    f = policy_loss
    with pytest.raises(ValueError, match="old_logprobs shape"):
        f(lp, torch.zeros(2, 4), adv, mask)
    with pytest.raises(ValueError, match="3 entries"):
        f(lp, lp, torch.zeros(3), mask)
    with pytest.raises(ValueError, match="only 0 and 1"):
        f(lp, lp, adv, torch.full((2, 3), 0.5))
    with pytest.raises(ValueError, match="logprobs must have 2"):
        f(torch.zeros(6), torch.zeros(6), adv, mask)
    with pytest.raises(ValueError, match="kl_coef=0.1 > 0 needs ref_logprobs"):
        f(lp, lp, adv, mask, PolicyLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy_coef"):
        f(lp, lp, adv, mask, PolicyLossConfig(entropy_coef=0.01))
    with pytest.raises(ValueError, match="tis_level='token' needs rollout_logprobs"):
        f(lp, lp, adv, mask, PolicyLossConfig(tis_level="token"))
    norm = compute_step_normalizer([mask], "seq-mean-token-mean")
    with pytest.raises(ValueError, match="loss_agg_mode='seq-mean-token-mean'"):
        f(lp, lp, adv, mask, PolicyLossConfig(), normalizer=norm)
    small = StepNormalizer("token-mean", num_tokens=4, num_sequences=2, max_length=2, l_norm=2)
    with pytest.raises(ValueError, match="computed from other masks"):
        f(lp, lp, adv, mask, PolicyLossConfig(), normalizer=small)
    with pytest.raises(ValueError, match="PolicyLossConfig"):
        f(lp, lp, adv, mask, {"eps_low": 0.2})
    with pytest.raises(ValueError, match="floating-point"):
        f(lp.long(), lp, adv, mask)
