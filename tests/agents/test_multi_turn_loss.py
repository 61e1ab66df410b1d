"""The multi-turn loss through the trainer's own path (trajectories with observation masks ->
DP split -> mini-batches -> token-budget micro-batches -> make_loss_fn with the step's global
normalizer) equals the float64 re-derivation of the papers' formulas sample by sample, token by
token, where only the model's tokens count: observation tokens are out of the loss, the token
count, the sequence ratio (GSPO) and the sequence lengths. Loss and gradient do not depend on
the micro-batch budget or the DP split.

DP ranks are simulated in one process: each rank's losses use the normalizer counted over every
rank's masks, which is what the all-reduce in compute_step_normalizer gives them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "algorithms"))

from _algo_cases import oracle_loss  # noqa: E402
from megatron_rl.algorithms import RECIPES, compute_step_normalizer  # noqa: E402
from megatron_rl.train.experience import (Trajectory, make_loss_fn, my_groups, pack_minibatch,  # noqa: E402
                                          response_masks)

GROUPS, G = 3, 4


def trajectories(seed: int = 0) -> list[list[Trajectory]]:
    """Multi-turn trajectories: 1-3 model turns, an observation between turns (mask 0), one
    truncated trajectory, varied prompt lengths."""
    rng = torch.Generator().manual_seed(seed)
    groups = []
    for group in range(GROUPS):
        members = []
        for sample in range(G):
            mask: list[int] = []
            turns = 1 + int(torch.randint(0, 3, (1,), generator=rng))
            for turn in range(turns):
                mask += [1] * int(torch.randint(2, 7, (1,), generator=rng))
                if turn < turns - 1:
                    mask += [0] * int(torch.randint(3, 9, (1,), generator=rng))
            prompt = list(range(1, 3 + int(torch.randint(0, 5, (1,), generator=rng))))
            length = len(mask)
            t = Trajectory(group, prompt, list(range(7, 7 + length)),
                           rollout_logprobs=(-torch.rand(length, generator=rng) - 0.1).tolist(),
                           truncated=(group, sample) == (1, 2), reward=float(sample % 2), loss_mask=mask,
                           advantage=float(torch.randn(1, generator=rng)))
            # float32 values (the trainer stores old logprobs in float32): exact in both paths
            t.old_logprobs = (-torch.rand(length, generator=rng) - 0.1).double()
            t.ref_logprobs = (-torch.rand(length, generator=rng) - 0.1).double()
            # the policy's current logprobs: the leaves whose gradient is compared
            t.current = (t.old_logprobs + 0.2 * torch.randn(length, generator=rng, dtype=torch.float64)).requires_grad_()
            members.append(t)
        groups.append(members)
    return groups


def packed_logprobs(batch, rows: list[Trajectory]) -> torch.Tensor:
    """[T] logprobs of a packed micro-batch: response token j of a sample sits at the position
    that predicts it (start + prompt - 1 + j); other positions are constants."""
    pieces, cursor = [], 0
    for (start, prompt, length), sample_id in zip(batch.spans, batch.sample_ids):
        first = start + prompt - 1
        pieces.append(torch.full((first - cursor,), -3.0, dtype=torch.float64))
        pieces.append(rows[sample_id].current)
        cursor = first + length - prompt
    pieces.append(torch.full((batch.num_tokens - cursor,), -3.0, dtype=torch.float64))
    return torch.cat(pieces)


def trainer_step(groups, recipe, *, dp: int, budget: int, updates: int = 1):
    """Sum of every rank's micro-batch losses (what the all-reduced gradient is the gradient of)."""
    ranks = [my_groups(groups, rank, dp) for rank in range(dp)]
    per_rank = []
    for mine in ranks:
        flat = [t for group in mine for t in group]
        chunks = [flat[i::updates] for i in range(updates)] if updates > 1 else [flat]
        per_rank.append([(chunk, pack_minibatch(chunk, budget, 1)) for chunk in chunks])
    total = torch.zeros((), dtype=torch.float64)
    for update in range(updates):
        masks = [m for rank in per_rank for m in response_masks(rank[update][1], rank[update][0], recipe)]
        normalizer = compute_step_normalizer(masks, recipe.loss.loss_agg_mode, recipe.loss.l_norm)
        for rank in per_rank:
            chunk, batches = rank[update]
            if not chunk:
                continue
            loss_fn = make_loss_fn(chunk, recipe, normalizer, old_from_forward=False,
                                   use_ref=recipe.loss.kl_coef > 0, max_turns=3)
            for batch in batches:
                loss, metrics = loss_fn(packed_logprobs(batch, chunk), None, batch)
                total = total + loss
    return total


def oracle(groups, recipe) -> torch.Tensor:
    """The float64 re-derivation on one padded batch whose mask is the model's tokens only."""
    rows = [t for group in groups for t in group]
    width = max(t.length for t in rows)
    data = {key: torch.zeros(len(rows), width, dtype=torch.float64)
            for key in ("logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs")}
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    logprobs = []
    for row, t in enumerate(rows):
        pad = torch.zeros(width - t.length, dtype=torch.float64)
        logprobs.append(torch.cat([t.current, pad]))
        data["old_logprobs"][row, : t.length] = t.old_logprobs
        data["ref_logprobs"][row, : t.length] = t.ref_logprobs
        data["rollout_logprobs"][row, : t.length] = torch.tensor(t.rollout_logprobs, dtype=torch.float64)
        if not (recipe.mask_truncated and t.truncated):
            mask[row, : t.length] = torch.tensor(t.loss_mask, dtype=torch.bool)
    data["logprobs"] = torch.stack(logprobs)
    data["mask"] = mask
    data["advantages"] = torch.tensor([t.advantage for t in rows], dtype=torch.float64)
    return oracle_loss(data, recipe.loss)


def grads(groups) -> torch.Tensor:
    return torch.cat([t.current.grad.clone() for group in groups for t in group])


@pytest.mark.parametrize("name", ["dapo", "grpo", "dr_grpo", "gspo"])
def test_multi_turn_loss_and_gradient_match_float64_oracle_for_any_split(name):
    recipe = RECIPES[name]
    groups = trajectories()
    expected = oracle(groups, recipe)
    expected.backward()
    want = grads(groups)
    observation = torch.cat([torch.tensor(t.loss_mask) == 0 for group in groups for t in group])
    assert observation.sum() > 20 and want[~observation].abs().max() > 0
    assert torch.all(want[observation] == 0)  # the oracle's observations have no gradient
    for dp, budget in [(1, 4096), (1, 24), (2, 40), (3, 17)]:
        for group in groups:
            for t in group:
                t.current.grad = None
        got = trainer_step(groups, recipe, dp=dp, budget=budget)
        got.backward()
        torch.testing.assert_close(got, expected.detach(), rtol=1e-12, atol=1e-12,
                                   msg=f"{name} loss, dp={dp} budget={budget}")
        torch.testing.assert_close(grads(groups), want, rtol=1e-10, atol=1e-12,
                                   msg=f"{name} gradient, dp={dp} budget={budget}")


def test_an_observation_token_in_the_loss_would_be_caught():
    """The same comparison with one observation token wrongly scored (an off-by-one mask) fails."""
    recipe = RECIPES["dapo"]
    groups = trajectories()
    expected = oracle(groups, recipe)
    victim = next(t for group in groups for t in group if 0 in t.loss_mask)
    first_zero = victim.loss_mask.index(0)
    victim.loss_mask = victim.loss_mask[:first_zero] + [1] + victim.loss_mask[first_zero + 1:]
    got = trainer_step(groups, recipe, dp=1, budget=4096)
    assert not torch.allclose(got, expected.detach(), rtol=1e-9, atol=1e-12)
