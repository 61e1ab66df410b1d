"""Off-policy corrections against the engine's logprobs mu (rl.off_policy): IcePop, MIS at token and
sequence level and DeepSeek-V3.2's off-policy sequence mask, each against numbers worked by hand
from the papers' definitions (values and gradients, float64); masked tokens leave the normaliser
(N_tokens, |o_i|, N_seqs); the mismatch metrics; the trainer's path (kept masks -> normaliser ->
loss); the config's names, the former tis_* keys and the refusals. The micro-batch / DP / CP
invariance of every correction with every loss and aggregation is tests/algorithms/
test_algo_invariance.py (its cases rotate these corrections through all of them)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms import (PolicyLossConfig, compute_step_normalizer, off_policy_keep, policy_loss,
                                    reduce_metrics)
from megatron_rl.algorithms.from_config import recipe_for
from megatron_rl.config import parse_config
from megatron_rl.errors import ConfigError

LN = math.log
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
LP = torch.full((2, 3), -1.0, dtype=torch.float64)  # pi_theta = pi_old: every PPO ratio is 1
# mu per token, chosen so that rho = pi_old / mu = exp(old - mu) is 1, 8, 1/4 | 2, 0.8
MU = torch.tensor([[-1.0, -1.0 - LN(8), -1.0 + LN(4)], [-1.0 - LN(2), -1.0 - LN(0.8), 0.0]], dtype=torch.float64)
ADV = torch.tensor([1.0, -2.0], dtype=torch.float64)


def run(cfg, *, lp=LP, old=LP, mu=MU, adv=ADV, mask=MASK, normalizer=None, **kw):
    x = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(x, old, adv, mask, cfg, rollout_logprobs=mu, normalizer=normalizer, **kw)
    loss.backward()
    return loss.item(), x.grad, reduce_metrics([metrics])


def grad(values):
    """The hand-derived gradient as a [2, 3] tensor (rows: samples)."""
    return torch.tensor(values, dtype=torch.float64)


# With r = 1 inside the clip the PPO term of a kept token is -A r w, whose derivative in logp is
# -A w (times the token's aggregation weight); a masked token contributes nothing.
def test_icepop_masks_outside_the_band_and_corrects_inside():
    cfg = PolicyLossConfig(tis_level="token", tis_mode="mask", tis_lower=0.5, tis_upper=5.0,
                           loss_agg_mode="token-mean")
    loss, g, out = run(cfg)
    # kept: (0,0) rho 1, (1,0) rho 2, (1,1) rho 0.8; 8 > 5 and 1/4 < 0.5 are masked: N = 3, not 5
    assert loss == pytest.approx((-1 * 1 + 2 * 2 + 2 * 0.8) / 3, rel=1e-12, abs=0)
    torch.testing.assert_close(g, grad([[-1 / 3, 0, 0], [2 * 2 / 3, 2 * 0.8 / 3, 0]]), rtol=1e-12, atol=0)
    assert out["count/tokens"] == 3 and out["mismatch/tokens"] == 5
    assert out["mismatch/masked_frac"] == pytest.approx(2 / 5) and out["tis/masked_frac"] == pytest.approx(2 / 5)
    # GRPO's per-sample mean: |o_0| = 1 and |o_1| = 2 count only kept tokens
    loss, g, _ = run(cfg.replace(loss_agg_mode="seq-mean-token-mean"))
    assert loss == pytest.approx(-1 / (2 * 1) + (2 * 2 + 2 * 0.8) / (2 * 2), rel=1e-12, abs=0)
    torch.testing.assert_close(g, grad([[-1 / 2, 0, 0], [2 * 2 / 4, 2 * 0.8 / 4, 0]]), rtol=1e-12, atol=0)


def test_mis_token_drops_weights_above_the_threshold_only():
    cfg = PolicyLossConfig(tis_level="token", tis_mode="mask", tis_upper=2.5, loss_agg_mode="token-mean")
    loss, g, _ = run(cfg)
    # rho 8 dropped; 1/4 stays (no lower bound) and 2 stays (below the threshold): N = 4
    assert loss == pytest.approx((-1 * 1 - 1 * 0.25 + 2 * 2 + 2 * 0.8) / 4, rel=1e-12, abs=0)
    torch.testing.assert_close(g, grad([[-1 / 4, 0, -0.25 / 4], [2 * 2 / 4, 2 * 0.8 / 4, 0]]), rtol=1e-12, atol=0)
    # truncation instead (TIS) keeps the token at weight 2.5 and every token in the count
    loss_t, _, _ = run(cfg.replace(tis_mode="truncate"))
    assert loss_t == pytest.approx((-1 - 2.5 - 0.25 + 4 + 1.6) / 5, rel=1e-12, abs=0)


def test_mis_sequence_drops_the_whole_sample_and_its_count():
    cfg = PolicyLossConfig(tis_level="sequence", tis_mode="mask", tis_upper=1.8, loss_agg_mode="seq-mean-token-mean")
    loss, g, out = run(cfg)
    # products: sample 0: 1 * 8 * 1/4 = 2 > 1.8 -> dropped; sample 1: 2 * 0.8 = 1.6, weight 1.6 on its tokens.
    # N_seqs = 1 (the dropped sample leaves it): -A w / (N_seqs |o_1|) = 2 * 1.6 / 2 per token
    assert loss == pytest.approx(2 * 1.6 * 2 / (1 * 2), rel=1e-12, abs=0)
    torch.testing.assert_close(g, grad([[0, 0, 0], [1.6, 1.6, 0]]), rtol=1e-12, atol=0)
    assert out["count/sequences"] == 1 and out["mismatch/sequences"] == 2
    assert out["mismatch/masked_frac"] == pytest.approx(3 / 5)
    loss, g, _ = run(cfg.replace(loss_agg_mode="seq-mean-token-sum-norm", l_norm=4.0))  # Dr. GRPO: 1/(N_seqs L)
    torch.testing.assert_close(g, grad([[0, 0, 0], [2 * 1.6 / 4, 2 * 1.6 / 4, 0]]), rtol=1e-12, atol=0)


# DeepSeek-V3.2: KL_i = 1/|o_i| sum_t (log mu - log pi_theta); a token with A < 0 leaves the loss
# when KL_i > delta.
OPSM_MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
OPSM_LP = torch.full((3, 3), -1.0, dtype=torch.float64)
OPSM_MU = torch.tensor([[-0.5, -0.8, -1.0],    # KL_0 = (0.5 + 0.2 + 0) / 3 = 0.2333 > 0.2, A < 0: dropped
                        [-0.9, -1.3, 0.0],     # KL_1 = (0.1 - 0.3) / 2 = -0.1: kept
                        [-0.2, 0.0, 0.0]], dtype=torch.float64)  # KL_2 = 0.8 but A > 0: kept
OPSM_ADV = torch.tensor([-1.0, -2.0, 1.0], dtype=torch.float64)


def test_deepseek_v32_sequence_mask_drops_negative_samples_far_from_mu():
    cfg = PolicyLossConfig(opsm_delta=0.2, loss_agg_mode="token-mean")
    loss, g, out = run(cfg, lp=OPSM_LP, old=OPSM_LP, mu=OPSM_MU, adv=OPSM_ADV, mask=OPSM_MASK)
    assert loss == pytest.approx((2 + 2 - 1) / 3, rel=1e-12, abs=0)  # 3 kept tokens, not 6
    torch.testing.assert_close(g, torch.tensor([[0, 0, 0], [2 / 3, 2 / 3, 0], [-1 / 3, 0, 0]], dtype=torch.float64),
                               rtol=1e-12, atol=0)
    assert out["mismatch/opsm_seq_frac"] == pytest.approx(1 / 3) and out["count/sequences"] == 2
    # delta just above KL_0 keeps it
    loss, _, _ = run(cfg.replace(opsm_delta=0.234), lp=OPSM_LP, old=OPSM_LP, mu=OPSM_MU, adv=OPSM_ADV, mask=OPSM_MASK)
    assert loss == pytest.approx((1 + 1 + 1 + 2 + 2 - 1) / 6, rel=1e-12, abs=0)
    # per-token advantages: the condition is per token (the paper's M_{i,t})
    adv = torch.tensor([[-1.0, 1.0, -1.0], [-2.0, -2.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    _, g, _ = run(cfg, lp=OPSM_LP, old=OPSM_LP, mu=OPSM_MU, adv=adv, mask=OPSM_MASK)
    torch.testing.assert_close(g, torch.tensor([[0, -1 / 4, 0], [2 / 4, 2 / 4, 0], [-1 / 4, 0, 0]],
                                               dtype=torch.float64), rtol=1e-12, atol=0)


def test_sequence_mask_measures_the_policy_being_updated():
    """The KL is against pi_theta (the update-start logprobs the normaliser used), not pi_old:
    with pi_theta = mu on sample 0 its KL is 0 and it stays."""
    cfg = PolicyLossConfig(opsm_delta=0.2)
    keep = off_policy_keep(OPSM_MASK, cfg, old_logprobs=OPSM_LP, rollout_logprobs=OPSM_MU, advantages=OPSM_ADV,
                           logprobs=OPSM_LP)
    assert keep.tolist() == [[False] * 3, [True, True, False], [True, False, False]]
    theta = torch.where(torch.arange(3).unsqueeze(1) == 0, OPSM_MU, OPSM_LP)
    keep = off_policy_keep(OPSM_MASK, cfg, old_logprobs=OPSM_LP, rollout_logprobs=OPSM_MU, advantages=OPSM_ADV,
                           logprobs=theta)
    assert keep.tolist() == OPSM_MASK.tolist()
    # In the loss: pi_old = mu (so a KL against pi_old would be 0 and drop nothing), pi_theta =
    # the logprobs: sample 0 leaves, exactly as if it were not in the step.
    cases = dict(old=OPSM_MU, mu=OPSM_MU, adv=OPSM_ADV)
    loss, g, out = run(cfg, lp=OPSM_LP, mask=OPSM_MASK, **cases)
    without = OPSM_MASK.clone()
    without[0] = False
    ref, g_ref, _ = run(PolicyLossConfig(), lp=OPSM_LP, mask=without, **cases)
    assert out["mismatch/opsm_seq_frac"] == pytest.approx(1 / 3)
    assert loss == pytest.approx(ref, rel=1e-12, abs=0)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=0)
    # opsm_logprobs (the update-start pi_theta the normaliser used) decides, not this forward's
    loss, _, out = run(cfg, lp=OPSM_LP, mask=OPSM_MASK, opsm_logprobs=OPSM_MU, **cases)
    assert out["mismatch/opsm_seq_frac"] == 0
    assert loss == pytest.approx(run(PolicyLossConfig(), lp=OPSM_LP, mask=OPSM_MASK, **cases)[0], rel=1e-12, abs=0)
    with pytest.raises(ValueError, match="opsm_delta=0.2 needs logprobs"):
        off_policy_keep(OPSM_MASK, cfg, old_logprobs=OPSM_LP, rollout_logprobs=OPSM_MU, advantages=OPSM_ADV)


def test_step_normaliser_must_count_the_kept_tokens():
    """Split into two micro-batches with a step normaliser: from off_policy_keep's masks the
    sum equals the whole step; from the plain masks (masked tokens still counted, the slime #657
    bug) the loss is 3/5 of it."""
    cfg = PolicyLossConfig(tis_level="token", tis_mode="mask", tis_lower=0.5, tis_upper=5.0)
    whole, _, _ = run(cfg)
    rows = [slice(0, 1), slice(1, 2)]
    kept = [off_policy_keep(MASK[r], cfg, old_logprobs=LP[r], rollout_logprobs=MU[r], advantages=ADV[r]) for r in rows]
    good = compute_step_normalizer(kept, cfg.loss_agg_mode)
    bad = compute_step_normalizer([MASK[r] for r in rows], cfg.loss_agg_mode)
    assert (good.num_tokens, bad.num_tokens) == (3, 5)
    split = [sum(run(cfg, lp=LP[r], old=LP[r], mu=MU[r], adv=ADV[r], mask=MASK[r], normalizer=n)[0] for r in rows)
             for n in (good, bad)]
    assert split[0] == pytest.approx(whole, rel=1e-12, abs=0)
    assert split[1] == pytest.approx(whole * 3 / 5, rel=1e-12, abs=0)


def test_mismatch_metrics_by_hand():
    cfg = PolicyLossConfig(tis_level="token", tis_mode="mask", tis_lower=0.5, tis_upper=5.0)
    _, _, out = run(cfg)
    d = [0.0, LN(8), -LN(4), LN(2), LN(0.8)]  # log pi_old - log mu = log rho, the five loss tokens
    rho = [math.exp(x) for x in d]
    assert out["mismatch/logp_abs_diff_mean"] == pytest.approx(sum(abs(x) for x in d) / 5, rel=1e-12)
    assert out["mismatch/logp_abs_diff_max"] == pytest.approx(LN(8), rel=1e-12)
    assert out["mismatch/kl"] == pytest.approx(sum(r - 1 - x for r, x in zip(rho, d)) / 5, rel=1e-12)  # k3 KL(mu||pi)
    assert out["mismatch/chi2_token"] == pytest.approx(sum(r * r for r in rho) / 5 - 1, rel=1e-12)
    seq = [rho[0] * rho[1] * rho[2], rho[3] * rho[4]]  # 2 and 1.6
    assert out["mismatch/chi2_seq"] == pytest.approx(sum(s * s for s in seq) / 2 - 1, rel=1e-12)
    assert out["tis/weight_mean"] == pytest.approx((1 + 0 + 0 + rho[3] + rho[4]) / 5, rel=1e-12)


# ----------------------------------------------------------------------------- the trainer's path
def test_trainer_masks_normaliser_and_loss_agree():
    """experience.kept_masks -> step_normalizer -> make_loss_fn: the masked tokens leave the
    normaliser the trainer builds, and the loss equals the hand value."""
    from megatron_rl.model.packing import pack
    from megatron_rl.train.experience import Trajectory, kept_masks, make_loss_fn, response_masks, step_normalizer
    from megatron_rl.train.update import LossSettings

    mu = [[-1.0, -1.0 - LN(8), -1.0 + LN(4)], [-1.0 - LN(2), -1.0 - LN(0.8)]]
    trajs = [Trajectory(group=0, prompt_ids=[1, 2], response_ids=[5] * len(m), rollout_logprobs=m, truncated=False,
                        reward=0.0, advantage=a, old_logprobs=torch.full((len(m),), -1.0)) for m, a in zip(mu, [1.0, -2.0])]
    config = parse_config({"rl": {"updates_per_rollout": 1, "off_policy": {"method": "icepop"}}}, "run.yaml")
    recipe = recipe_for(config.rl)
    settings = LossSettings.for_run(config, recipe)
    assert not settings.old_from_forward  # the masks are decided before the update's first backward
    batch = pack([t.prompt_ids + t.response_ids for t in trajs], [len(t.prompt_ids) for t in trajs])
    masks = kept_masks([batch], trajs, recipe, response_masks([batch], trajs, recipe))
    assert masks[0].tolist() == [[True, False, False], [True, True, False]]
    normalizer = step_normalizer(masks, recipe, None, torch.device("cpu"))
    loss_fn = make_loss_fn(trajs, recipe, normalizer, old_from_forward=False, use_ref=False)
    logprobs = torch.full((batch.num_tokens,), -1.0, dtype=torch.float64)
    loss, metrics = loss_fn(logprobs, None, batch)
    assert loss.item() == pytest.approx((-1 * 1 + 2 * 2 + 2 * 0.8) / 3, rel=1e-6)  # float32 storage
    assert reduce_metrics(metrics)["mismatch/masked_frac"] == pytest.approx(2 / 5)


# ----------------------------------------------------------------------------- config
def rl_section(**off_policy):
    return parse_config({"rl": {"off_policy": off_policy}}, "run.yaml").validate("run.yaml").rl


@pytest.mark.parametrize("method,want", [
    ("tis", ("token", "truncate", 2.0, None)),
    ("icepop", ("token", "mask", 5.0, 0.5)),
    ("mis", ("token", "mask", 2.0, None)),
])
def test_off_policy_names_select_the_loss_fields(method, want):
    loss = recipe_for(rl_section(method=method)).loss
    assert (loss.tis_level, loss.tis_mode, loss.tis_upper, loss.tis_lower) == want
    seq = recipe_for(rl_section(method="mis", level="sequence", high=3.0)).loss
    assert (seq.tis_level, seq.tis_mode, seq.tis_upper) == ("sequence", "mask", 3.0)
    assert recipe_for(rl_section(opsm_delta=1e-4)).loss.opsm_delta == 1e-4  # with any method, or none
    assert recipe_for(parse_config({"rl": {"recipe": "olmo3", "off_policy": {"method": "off"}}}, "r").rl).loss.tis_level is None


def test_former_tis_keys_still_select_the_same_loss():
    legacy = parse_config({"rl": {"tis_level": "sequence", "tis_mode": "mask", "tis_upper": 3.0}}, "r").rl
    assert recipe_for(legacy).loss == recipe_for(rl_section(method="mis", level="sequence", high=3.0)).loss
    assert recipe_for(parse_config({"rl": {"tis_upper": 2.0}}, "r").rl).loss.tis_level == "token"


@pytest.mark.parametrize("section,message", [
    ({"method": "icepop", "low": 0.8, "high": 0.6}, "rl.off_policy.low=0.8 must be < high=0.6"),
    ({"method": "mis", "high": -2.0}, "rl.off_policy.high must be a finite number >= 0"),
    ({"method": "tis", "low": 1.5}, "rl.off_policy.low=1.5 must be in (0, 1)"),
    ({"method": "mis", "high": 0.9}, "rl.off_policy.high=0.9 must be > 1"),
    ({"opsm_delta": -0.1}, "rl.off_policy.opsm_delta must be a finite number >= 0"),
    ({"method": "icepop", "level": "sequence"}, "icepop masks tokens"),
    ({"level": "sequence"}, "rl.off_policy.level has no effect without a correction"),
])
def test_bad_off_policy_values_are_refused_by_key(section, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        rl_section(**section)


def test_unknown_method_and_both_spellings_are_refused():
    with pytest.raises(ConfigError, match="rl.off_policy.method"):
        rl_section(method="popice")
    with pytest.raises(ConfigError, match="rl.off_policy.method and rl.tis_upper both choose"):
        parse_config({"rl": {"tis_upper": 2.0, "off_policy": {"method": "icepop"}}}, "run.yaml").validate("run.yaml")
