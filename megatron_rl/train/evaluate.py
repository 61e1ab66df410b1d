"""Held-out accuracy: one sample per prompt (greedy by default), scored by the run's reward functions."""

from __future__ import annotations

import torch

from megatron_rl.rewards.functions import CORRECT
from megatron_rl.train.collect import eval_params
from megatron_rl.train.scoring import GroupScorer


def evaluate(heldout, rl, seed: int, generation, scorer: GroupScorer) -> dict:
    """Collective. `heldout`: the held-out dataset (None or empty: nothing to report); `rl`: the
    RLConfig (eval_prompts, eval_temperature, the token budget); `generation`: records -> samples
    (train/generation.py; multi-turn tasks are evaluated over whole trajectories)."""
    if heldout is None or len(heldout) == 0:
        return {}
    records = list(heldout)[: rl.eval_prompts or len(heldout)]
    samples = generation.groups(records, eval_params(rl, seed))
    scored, _ = scorer.score(records, samples)
    rewards = torch.tensor([g[0].reward for g in scored], dtype=torch.float64)
    lengths = torch.tensor([g[0].model_length for g in scored], dtype=torch.float64)
    metrics = {"eval/accuracy": float((rewards >= CORRECT).double().mean()), "eval/reward_mean": float(rewards.mean()),
               "eval/length_mean": float(lengths.mean()), "eval/prompts": len(records)}
    if scored and scored[0][0].agent is not None:
        calls = [g[0].agent["info"].get("tool_calls", 0.0) for g in scored]
        metrics["eval/tool_call_rate"] = sum(c > 0 for c in calls) / len(calls)
        metrics["eval/turns_mean"] = sum(g[0].agent["turns"] for g in scored) / len(scored)
        metrics["eval/failed"] = float(sum(g[0].agent["status"] == "failed" for g in scored))
    return metrics
