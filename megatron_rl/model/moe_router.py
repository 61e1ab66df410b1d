"""Group-limited top-k exactly as DeepSeek-V3 (and vLLM, and transformers) choose experts.

DeepSeek-V3's router ranks the expert groups by the sum of each group's TOP-2 biased scores,
keeps `topk_group` groups, and takes the top-k experts among them. Megatron-Core's
`group_limited_topk` ranks groups by their top-(k / topk_group) scores instead: the same numbers
for DeepSeek-V3 itself (8 / 4 = 2), different ones for other settings (k=6 over 3 groups, k=4
over 4 groups, ...), and then the trained model would route differently from the checkpoint's
own definition and from the rollout engine.

Megatron-Core builds the router from the layer spec (`MoESubmodules.router`), and hands its
top-k choice to the router's `RouterReplay` object together with the default top-k function.
`GroupLimitedRouter` puts a small proxy in front of that object which swaps in the DeepSeek
rule as the default, so routing replay (model/routing.py, which wraps the same object) records,
replays and measures drift against the DeepSeek choice too.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter


def deepseek_group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int | None = None,
                                group_topk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen scores, expert indices) for [tokens, experts] scores: groups ranked by their top-2 sum."""
    if not group_topk:
        return torch.topk(scores, k=topk, dim=1)
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    chosen_groups = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, chosen_groups, 1)
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
    masked = scores.masked_fill(~expert_mask.bool(), float("-inf"))
    return torch.topk(masked, k=topk, dim=-1)


class _DeepSeekTopk:
    """Stands in for the router's RouterReplay: same call, DeepSeek's rule as the default top-k.

    The wrapped object is looked up at call time, so a RouterTrace attached after the model was
    built (it replaces `get_replay_topk` on the RouterReplay instance) is still the one called."""

    def __init__(self, replay):
        self.replay = replay

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        return self.replay.get_replay_topk(scores, topk, num_groups, group_topk, deepseek_group_limited_topk)

    def __getattr__(self, name):
        return getattr(self.replay, name)


class GroupLimitedRouter(TopKRouter):
    """TopKRouter choosing experts by DeepSeek-V3's group-limited rule (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.router_replay is None:
            raise ValueError("GroupLimitedRouter needs moe_enable_routing_replay (the builder sets it)")
        self.router_replay = _DeepSeekTopk(self.router_replay)
