"""Data-parallel load balance of one RL step's groups: round-robin vs by token count.

Every data-parallel rank trains on its share of the step's groups, and the ranks wait for each
other at every optimizer step, so a step takes as long as the most loaded rank. This draws RL-like
length mixes and reports, per setting, the most loaded rank's tokens over the mean (1.00 = even)
for the old assignment (groups[rank::dp]) and for `experience.my_groups` (whole groups, greedy
longest-processing-time by prompt + response tokens), and the same for the mini-batches a rank
steps through (`experience.minibatches`, rl.updates_per_rollout of them): there the cost of an
update is the most loaded rank's share of that mini-batch, so the figure is
sum over mini-batches of max over ranks / (all tokens / dp).

The length mix (long-tailed as RL rollouts are: most responses short, a few running into the
budget, lengths correlated within a group because they answer the same prompt):
  prompt tokens        uniform 32..512 per group (shared by its samples)
  group scale          log-normal, median 15% of max_response_tokens, sigma 0.8
  response tokens      group scale x log-normal(0, 0.6), clipped to 1..max_response_tokens
                       (the clipped ones are the truncated responses)

    python benchmarks/dp_balance.py                          # the table of results/dp_balance_cpu.md
    python benchmarks/dp_balance.py --seeds 3 --groups 64 --dp 8

Pure Python, no model: seconds on one CPU core.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.train.experience import Trajectory, group_tokens, minibatches, my_groups  # noqa: E402


def draw_groups(count: int, group_size: int, max_response_tokens: int, seed: int) -> list[list[Trajectory]]:
    """A step's groups with the long-tailed length mix above (token ids are ranges: only lengths matter)."""
    rng = random.Random(seed)
    groups = []
    for index in range(count):
        prompt = range(rng.randint(32, 512))
        scale = 0.15 * max_response_tokens * rng.lognormvariate(0.0, 0.8)
        group = []
        for _ in range(group_size):
            length = int(min(max(1.0, scale * rng.lognormvariate(0.0, 0.6)), max_response_tokens))
            group.append(Trajectory(group=index, prompt_ids=prompt, response_ids=range(length), rollout_logprobs=[],
                                    truncated=length == max_response_tokens, reward=0.0))
        groups.append(group)
    return groups


def round_robin(groups, dp_rank: int, dp_size: int):
    return groups[dp_rank::dp_size]


def round_robin_minibatches(groups, count: int):
    return [[t for group in groups[index::count] for t in group] for index in range(count)]


def rank_imbalance(groups, dp: int, assign) -> float:
    loads = [sum(map(group_tokens, assign(groups, rank, dp))) for rank in range(dp)]
    return max(loads) / statistics.fmean(loads)


def update_imbalance(groups, dp: int, assign, split, updates: int) -> float:
    """sum over mini-batches of the most loaded rank's tokens, over the even share (total / dp)."""
    per_rank = [[sum(len(t.prompt_ids) + t.length for t in batch) for batch in split(assign(groups, rank, dp), updates)]
                for rank in range(dp)]
    total = sum(map(sum, per_rank))
    return sum(max(rank[i] for rank in per_rank) for i in range(updates)) / (total / dp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--groups", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--group-size", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--max-response-tokens", type=int, default=8192)
    parser.add_argument("--updates", type=int, default=4, help="mini-batches per step (rl.updates_per_rollout)")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    truncated = samples = 0
    print(f"max/mean tokens per rank (worst and median of {args.seeds} seeds); max_response_tokens "
          f"{args.max_response_tokens}; mini-batches: {args.updates} per step")
    print("| groups x size | DP | round-robin worst | by-token worst | round-robin median | by-token median "
          "| mini-batches RR worst | mini-batches by-token worst |")
    print("|---|---|---|---|---|---|---|---|")
    worst_balanced = 0.0
    for count in args.groups:
        for size in args.group_size:
            steps = [draw_groups(count, size, args.max_response_tokens, seed) for seed in range(args.seeds)]
            for groups in steps:
                samples += sum(len(g) for g in groups)
                truncated += sum(t.truncated for g in groups for t in g)
            for dp in args.dp:
                old = [rank_imbalance(groups, dp, round_robin) for groups in steps]
                new = [rank_imbalance(groups, dp, my_groups) for groups in steps]
                old_mb = [update_imbalance(groups, dp, round_robin, round_robin_minibatches, args.updates) for groups in steps]
                new_mb = [update_imbalance(groups, dp, my_groups, minibatches, args.updates) for groups in steps]
                worst_balanced = max(worst_balanced, *new)
                print(f"| {count} x {size} | {dp} | {max(old):.3f} | {max(new):.3f} | {statistics.median(old):.3f} "
                      f"| {statistics.median(new):.3f} | {max(old_mb):.3f} | {max(new_mb):.3f} |")
    print(f"\ntruncated responses: {truncated / samples:.1%} of {samples}; worst by-token max/mean: "
          f"{worst_balanced:.3f}; {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
