"""Groups dealt to data-parallel ranks by token count (experience.my_groups), and a rank's groups
split into mini-batches (experience.minibatches), on an RL-like long-tailed length mix (the one of
benchmarks/dp_balance.py). Oracle for the bound: the mean load; round-robin on the same data
misses it, so the bound is not met by any assignment."""

from __future__ import annotations

import random
import statistics

import pytest

from megatron_rl.train.experience import (Trajectory, balanced_partition, group_tokens, minibatches, my_groups, pack_minibatch,
                                          pack_step)

MAX_RESPONSE = 8192


def draw_groups(count: int, seed: int) -> list[list[Trajectory]]:
    """Prompts 32-512 tokens, 8-16 samples a group, response lengths log-normal around a per-group
    log-normal scale (median 15% of the budget), clipped to the budget: most short, a few truncated."""
    rng = random.Random(seed)
    groups = []
    for index in range(count):
        prompt, scale = range(rng.randint(32, 512)), 0.15 * MAX_RESPONSE * rng.lognormvariate(0.0, 0.8)
        lengths = [int(min(max(1.0, scale * rng.lognormvariate(0.0, 0.6)), MAX_RESPONSE))
                   for _ in range(rng.randint(8, 16))]
        groups.append([Trajectory(group=index, prompt_ids=prompt, response_ids=range(n), rollout_logprobs=[],
                                  truncated=n == MAX_RESPONSE, reward=0.0) for n in lengths])
    return groups


def max_over_mean(parts: list[list[list[Trajectory]]]) -> float:
    loads = [sum(map(group_tokens, part)) for part in parts]
    return max(loads) / statistics.fmean(loads)


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_ranks_get_every_group_once_within_5_percent_of_the_mean(dp):
    groups = draw_groups(128, seed=dp)
    assert max(len(g[0].prompt_ids) + g[0].length for g in groups) > 5 * statistics.median(
        len(g[0].prompt_ids) + g[0].length for g in groups)  # long-tailed indeed
    ranks = [my_groups(groups, rank, dp) for rank in range(dp)]  # each rank computes it on its own
    assert sorted(id(g) for part in ranks for g in part) == sorted(map(id, groups))
    assert ranks == [my_groups(list(groups), rank, dp) for rank in range(dp)]  # a pure function of the data
    for part in ranks:  # kept in rollout order
        assert [g[0].group for g in part] == sorted(g[0].group for g in part)
    assert max_over_mean(ranks) <= 1.05
    if dp == 8:  # the old assignment misses the bound on the same data
        assert max_over_mean([groups[rank::dp] for rank in range(dp)]) > 1.05


def test_fewer_groups_than_ranks():
    groups = draw_groups(3, seed=0)
    ranks = [my_groups(groups, rank, 8) for rank in range(8)]
    assert sorted(len(part) for part in ranks) == [0] * 5 + [1] * 3
    assert len(pack_minibatch([], 64, 8)) == 1  # an empty rank trains on one zero-loss filler
    assert my_groups([], 0, 4) == [] and minibatches([], 2) == [[], []]


def test_minibatches_keep_round_robin_counts_and_balance_tokens():
    groups = draw_groups(66, seed=1)
    batches = minibatches(groups, 4)
    counts = [len(groups[i::4]) for i in range(4)]
    # whole groups, every trajectory once, as many groups per mini-batch as round-robin gives
    assert sorted(id(t) for batch in batches for t in batch) == sorted(id(t) for g in groups for t in g)
    assert [len({t.group for t in batch}) for batch in batches] == counts
    loads = [sum(len(t.prompt_ids) + t.length for t in batch) for batch in batches]
    assert max(loads) / statistics.fmean(loads) <= 1.05


def test_partition_ties_and_capacities():
    assert balanced_partition([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]  # ties: earlier item, lower part first
    assert balanced_partition([9, 1, 1, 1], 2, [2, 2]) == [[0, 3], [1, 2]]  # full, part 1 takes no more
    assert balanced_partition([], 3) == [[], [], []]
    with pytest.raises(ValueError, match="cannot hold"):
        balanced_partition([1, 2, 3], 2, [1, 1])


@pytest.mark.parametrize("groups, dp, updates, with_data", [(3, 8, 2, 1), (3, 1, 4, 3), (9, 4, 2, 2), (0, 2, 2, 0)])
def test_a_step_leaves_out_the_updates_no_rank_has_data_for(groups, dp, updates, with_data):
    """Every rank packs the same number of updates: those with data on some rank (an optimizer
    step on none would still move the weights; tests/train/test_empty_updates.py), and each kept
    mini-batch holds what it held with every update packed."""
    drawn = [[Trajectory(group=t.group, prompt_ids=list(t.prompt_ids), response_ids=list(t.response_ids),
                         rollout_logprobs=[], truncated=t.truncated, reward=0.0) for t in group]
             for group in draw_groups(groups, seed=groups)]
    steps = [pack_step(drawn, dp_rank=rank, dp_size=dp, updates=updates, token_budget=10**6, pad_to_multiple=8)
             for rank in range(dp)]
    assert {len(step.packed) for step in steps} == {with_data}
    assert {step.empty_updates for step in steps} == {updates - with_data}
    for rank, step in enumerate(steps):
        assert step.minibatches == minibatches(my_groups(drawn, rank, dp), updates)[:with_data]
    assert sum(len(batch) for step in steps for batch in step.minibatches) == sum(map(len, drawn))
