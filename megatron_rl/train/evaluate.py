"""Held-out accuracy: one sample per prompt (greedy by default), scored by the run's reward functions."""

from __future__ import annotations

import torch

from megatron_rl.train.collect import eval_params
from megatron_rl.train.scoring import CORRECT, GroupScorer


def evaluate(heldout, rl, seed: int, rollout, scorer: GroupScorer, encode) -> dict:
    """Collective. `heldout`: the held-out dataset (None or empty: nothing to report); `rl`: the
    RLConfig (eval_prompts, eval_temperature, the token budget)."""
    if heldout is None or len(heldout) == 0:
        return {}
    records = list(heldout)[: rl.eval_prompts or len(heldout)]
    samples = rollout.generate([encode(r.prompt) for r in records], eval_params(rl, seed))
    scored, _ = scorer.score(records, samples)
    rewards = torch.tensor([g[0].reward for g in scored], dtype=torch.float64)
    lengths = torch.tensor([g[0].length for g in scored], dtype=torch.float64)
    return {"eval/accuracy": float((rewards >= CORRECT).double().mean()), "eval/reward_mean": float(rewards.mean()),
            "eval/length_mean": float(lengths.mean()), "eval/prompts": len(records)}
