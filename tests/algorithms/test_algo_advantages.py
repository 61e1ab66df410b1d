"""Advantage estimators against hand computations and float64 loops, the seed walkthrough
(rewards 1.1, 0.1, 0.0, 1.1), and degenerate groups."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms import (ADVANTAGE_ESTIMATORS, compute_advantages, dynamic_sampling_keep,
                                    process_advantages, zero_spread_groups)

SEED_REWARDS = torch.tensor([[1.1, 0.1, 0.0, 1.1]], dtype=torch.float64)


def test_seed_walkthrough_population_std():
    a = compute_advantages(SEED_REWARDS, "grpo", std="population")[0]
    torch.testing.assert_close(a, torch.tensor([0.998, -0.903, -1.093, 0.998], dtype=torch.float64), atol=5e-4, rtol=0)
    d = compute_advantages(SEED_REWARDS, "dr_grpo")[0]
    torch.testing.assert_close(d, torch.tensor([0.525, -0.475, -0.575, 0.525], dtype=torch.float64), atol=1e-12, rtol=0)
    # by hand: mean 0.575, population variance (0.525^2*2 + 0.475^2 + 0.575^2) / 4
    sigma = math.sqrt((2 * 0.525**2 + 0.475**2 + 0.575**2) / 4)
    assert abs(a[2].item() - (-0.575 / (sigma + 1e-6))) < 1e-12
    # The default (unbiased, as torch.std) is sqrt(G/(G-1)) smaller: not the seed's numbers.
    u = compute_advantages(SEED_REWARDS, "grpo")[0]
    torch.testing.assert_close(u, d / (SEED_REWARDS.std() + 1e-6))
    assert abs(u[0].item() - 0.864) < 1e-3


def loops(rewards, fn):
    """Apply a per-group Python function (list of floats -> list of floats) row by row, float64."""
    return torch.tensor([fn([float(x) for x in row]) for row in rewards], dtype=torch.float64)


def _grpo(r, correction, eps=1e-6):
    m = sum(r) / len(r)
    sd = math.sqrt(sum((x - m) ** 2 for x in r) / (len(r) - correction))
    return [(x - m) / (sd + eps) for x in r]


def test_estimators_match_float64_loops():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(5, 6, generator=g, dtype=torch.float64)
    torch.testing.assert_close(compute_advantages(r, "grpo"), loops(r, lambda x: _grpo(x, 1)))
    torch.testing.assert_close(compute_advantages(r, "grpo", std="population"), loops(r, lambda x: _grpo(x, 0)))
    torch.testing.assert_close(compute_advantages(r, "dr_grpo"), loops(r, lambda x: [v - sum(x) / len(x) for v in x]))
    torch.testing.assert_close(
        compute_advantages(r, "rloo"),
        loops(r, lambda x: [v - (sum(x) - v) / (len(x) - 1) for v in x]),
    )
    # REINFORCE++-baseline: group-centered, then whitened over the whole batch.
    centered = [v for row in loops(r, lambda x: [v - sum(x) / len(x) for v in x]).tolist() for v in row]
    m = sum(centered) / len(centered)
    sd = math.sqrt(sum((v - m) ** 2 for v in centered) / (len(centered) - 1))
    want = torch.tensor([(v - m) / (sd + 1e-6) for v in centered], dtype=torch.float64).reshape(5, 6)
    torch.testing.assert_close(compute_advantages(r, "reinforce_plus_plus_baseline"), want)
    # token-weighted variant (verl whitens the broadcast per-token advantages)
    lengths = torch.randint(1, 9, (5, 6), generator=g)
    w = [float(x) for x in lengths.reshape(-1)]
    mw = sum(a * b for a, b in zip(w, centered)) / sum(w)
    var = sum(a * (b - mw) ** 2 for a, b in zip(w, centered)) / (sum(w) - 1)
    want = torch.tensor([(v - mw) / (math.sqrt(var) + 1e-6) for v in centered], dtype=torch.float64).reshape(5, 6)
    torch.testing.assert_close(compute_advantages(r, "reinforce_plus_plus_baseline", lengths=lengths), want)


@pytest.mark.parametrize("estimator", [e for e in ADVANTAGE_ESTIMATORS if e != "grpo_process"])
def test_all_equal_rewards_give_zero_advantages_without_nan(estimator):
    r = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0]])
    a = compute_advantages(r, estimator)
    assert torch.isfinite(a).all()
    if estimator != "reinforce_plus_plus_baseline":  # batch whitening shifts by the batch mean
        assert torch.equal(a[0], torch.zeros(4))
    assert a[1].abs().sum() > 0
    assert zero_spread_groups(r).tolist() == [True, False]
    assert dynamic_sampling_keep(r).tolist() == [False, True]


def test_group_of_one_rejected_and_input_errors():
    for est in ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"):
        with pytest.raises(ValueError, match="group size G=1"):
            compute_advantages(torch.ones(3, 1), est)
    with pytest.raises(ValueError, match=r"\[groups, G\]"):
        compute_advantages(torch.ones(4), "grpo")
    with pytest.raises(ValueError, match="estimator"):
        compute_advantages(torch.ones(2, 2), "ppo")
    with pytest.raises(ValueError, match="std"):
        compute_advantages(torch.ones(2, 2), "grpo", std="sample")
    with pytest.raises(ValueError, match="non-finite"):
        compute_advantages(torch.tensor([[1.0, float("nan")]]), "grpo")
    with pytest.raises(ValueError, match="step_mask"):
        compute_advantages(torch.ones(1, 2, 3), "grpo_process")


def test_dtypes():
    assert compute_advantages(torch.tensor([[1, 0, 1]]), "grpo").dtype == torch.float32  # int rewards
    assert compute_advantages(torch.tensor([[1.0, 0.0]], dtype=torch.float64), "rloo").dtype == torch.float64


def test_process_supervision_by_hand():
    # One group, G=2, 5 tokens. Sample 0: steps end at tokens 1 and 4 (rewards 1.0, 0.0);
    # sample 1: one step ending at token 2 (reward 0.5).
    rewards = torch.zeros(1, 2, 5, dtype=torch.float64)
    steps = torch.zeros(1, 2, 5, dtype=torch.bool)
    rewards[0, 0, 1], rewards[0, 0, 4], rewards[0, 1, 2] = 1.0, 0.0, 0.5
    steps[0, 0, 1] = steps[0, 0, 4] = steps[0, 1, 2] = True
    a = compute_advantages(rewards, "grpo_process", step_mask=steps, std="population")
    # normalized over the group's 3 step rewards {1.0, 0.0, 0.5}: mean 0.5, population std sqrt(1/6)
    sd = math.sqrt(1 / 6) + 1e-6
    n1, n2, n3 = 0.5 / sd, -0.5 / sd, 0.0
    want = torch.tensor([[[n1 + n2, n1 + n2, n2, n2, n2], [n3, n3, n3, 0.0, 0.0]]], dtype=torch.float64)
    torch.testing.assert_close(a, want)
    # mean-only variant and a group with a single step (normalizes to 0, no NaN)
    b = process_advantages(rewards, steps, normalize_by_std=False)
    torch.testing.assert_close(b[0, 0, 0], torch.tensor(0.0, dtype=torch.float64))
    torch.testing.assert_close(b[0, 0, 2], torch.tensor(-0.5, dtype=torch.float64))
    single = torch.zeros(1, 2, 3)
    one = torch.zeros(1, 2, 3, dtype=torch.bool)
    single[0, 0, 2], one[0, 0, 2] = 3.0, True
    c = process_advantages(single, one)
    assert torch.isfinite(c).all() and c.abs().sum() == 0
