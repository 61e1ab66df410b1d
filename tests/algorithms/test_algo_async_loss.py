"""Asynchronous RL, the loss side: with max_staleness >= 1 the loss is AReaL's decoupled objective
(token-level TIS against each token's own behaviour logprob), and the loss function reports the
train/behaviour mismatch per staleness with the same keys on every micro-batch."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms import compute_step_normalizer, reduce_metrics
from megatron_rl.config import RLConfig
from megatron_rl.train.experience import Trajectory, make_loss_fn
from megatron_rl.model.packing import pack
from megatron_rl.algorithms.from_config import recipe_for

# Values exact in float32 (the trajectories store them so); the current policy is float64.
OLD = [[-0.5, -1.25, -0.75, -2.0], [-0.25, -1.5, -1.0]]  # proximal policy (recomputed at the step's start)
ROLLOUT = [[-1.5, -1.0, -0.5, -2.25], [-0.5, -1.5, -0.125]]  # behaviour: the engine's per-token logprobs
CURRENT = [[-0.3, -1.4, -0.9, -1.6], [-0.2, -1.2, -1.1]]
ADVANTAGES = [0.75, -0.375]  # exact in float32, as make_loss_fn passes them
VERSIONS = [[3, 3, 4, 4], None]  # the first sample continued across a weight update
POLICY_VERSION = 4


def run(rollout=ROLLOUT, max_staleness=2, versions=VERSIONS):
    trajs = [Trajectory(group=0, prompt_ids=[1, 2], response_ids=[5] * len(old), rollout_logprobs=list(roll),
                        truncated=False, reward=0.0, advantage=adv, old_logprobs=torch.tensor(old), versions=ver)
             for old, roll, adv, ver in zip(OLD, rollout, ADVANTAGES, versions)]
    recipe = recipe_for(RLConfig(max_staleness=max_staleness))  # dapo: token-mean, clip 0.2 / 0.28
    batch = pack([t.prompt_ids + t.response_ids for t in trajs], [len(t.prompt_ids) for t in trajs])
    masks = [torch.ones(1, t.length, dtype=torch.bool) for t in trajs]
    normalizer = compute_step_normalizer(masks, recipe.loss.loss_agg_mode)
    loss_fn = make_loss_fn(trajs, recipe, normalizer, old_from_forward=False, use_ref=False,
                           policy_version=POLICY_VERSION, max_staleness=max_staleness)
    logprobs = torch.zeros(batch.num_tokens, dtype=torch.float64)
    for (begin, end), values in zip(batch.response_segments(), CURRENT):
        logprobs[begin:end] = torch.tensor(values, dtype=torch.float64)
    return recipe, loss_fn(logprobs, None, batch)


def decoupled_oracle(rollout, eps_low, eps_high, cap):
    """AReaL Eq. 5 in float64, token by token: -min(pi_prox/pi_behav, C) * min(r A, clip(r) A),
    r = pi_theta / pi_prox, averaged over all tokens (token-mean)."""
    total, count = 0.0, 0
    for cur, old, roll, adv in zip(CURRENT, OLD, rollout, ADVANTAGES):
        for lp, lp_prox, lp_behav in zip(cur, old, roll):
            r = math.exp(lp - lp_prox)
            weight = min(math.exp(lp_prox - lp_behav), cap)
            total += -weight * min(r * adv, min(max(r, 1 - eps_low), 1 + eps_high) * adv)
            count += 1
    return total / count


def test_decoupled_objective_uses_each_tokens_behaviour_logprob():
    recipe, (loss, metrics) = run()
    cfg = recipe.loss
    assert (cfg.tis_level, cfg.tis_mode, cfg.tis_upper) == ("token", "truncate", 2.0)  # turned on by max_staleness
    expected = decoupled_oracle(ROLLOUT, cfg.eps_low, cfg.eps_high, cfg.tis_upper)
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=0)
    # One token's behaviour logprob moves its weight from 2.0 (truncated: exp(1.0) > 2) to
    # exp(0.25): the loss moves exactly as the re-derivation says.
    changed = [list(row) for row in ROLLOUT]
    changed[0][0] = -0.75
    _, (loss2, _) = run(changed)
    assert loss2.item() == pytest.approx(decoupled_oracle(changed, cfg.eps_low, cfg.eps_high, 2.0), rel=1e-12, abs=0)
    assert abs(loss2.item() - loss.item()) > 1e-3
    step = reduce_metrics(metrics)
    assert step["tis/truncated_frac"] == pytest.approx(1 / 7)  # only (0, 0): log w = 1.0 > log 2


def test_mismatch_by_staleness_has_fixed_keys_and_hand_computed_values():
    _, (_, metrics) = run(max_staleness=2)
    step = reduce_metrics(metrics)
    # staleness 1: sample 0's tokens 0, 1 (version 3); staleness 0: its tokens 2, 3 and sample 1 (no versions)
    assert step["mismatch/staleness_1/tokens"] == 2
    assert step["mismatch/staleness_1/logp_abs_diff_mean"] == pytest.approx((1.0 + 0.25) / 2, rel=1e-12)
    assert step["mismatch/staleness_0/tokens"] == 5
    assert step["mismatch/staleness_0/logp_abs_diff_mean"] == pytest.approx((0.25 + 0.25 + 0.25 + 0 + 0.875) / 5,
                                                                            rel=1e-12)
    assert step["mismatch/staleness_2/tokens"] == 0 and "mismatch/staleness_2/logp_abs_diff_mean" not in step
    staleness_keys = {k for k in metrics if "staleness" in k}
    assert staleness_keys == {f"mismatch/staleness_{d}/{m}" for d in range(3)
                              for m in ("tokens/sum", "logp_abs_diff_mean/sub_tok_sum")}
    # Two micro-batches combine exactly (sums of sums over a sub-population's own count).
    assert reduce_metrics([metrics, metrics])["mismatch/staleness_1/logp_abs_diff_mean"] == pytest.approx(0.625)
    with pytest.raises(ValueError, match="needs 'a/tokens/sum'"):
        reduce_metrics({"a/x/sub_tok_sum": 1.0})


def test_synchronous_run_reports_no_staleness_keys():
    _, (_, metrics) = run(max_staleness=0)
    assert not any("staleness" in k for k in metrics)


def test_tokens_staler_than_max_staleness_are_refused():
    with pytest.raises(ValueError, match="outside"):
        run(max_staleness=1, versions=[[1, 1, 4, 4], None])  # 3 versions stale
