"""Which experts each router used in a forward, against the engine's routes (R3, rl.routing_replay=rollout).

Shared by the GPU engine stage's r3 check (benchmarks/gpu_engine_fp8_r3.py) and the suite's R3
worker (tests/rollout/r3_worker.py). A RouteProbe wraps RouterTrace's top-k (model/routing.py) so
that every forward records, per micro-batch and router, the experts it used and those the router
would have chosen itself; `compare` counts them against the routes the engine returned. The probe
patches the RouterTrace class: it is installed once in a process of its own (a check's child, a
test worker), never in the trainer.
"""

from __future__ import annotations

import torch


class RouteProbe:
    def __init__(self) -> None:
        # (mode, micro-batch, router) -> ([tokens, k] experts the forward used, those it would choose itself)
        self.used: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def install(self) -> None:
        from megatron_rl.model import routing

        make_topk, used = routing.RouterTrace._make_topk, self.used

        def probed(trace, layer, original):
            inner = make_topk(trace, layer, original)

            def topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
                probs, indices = inner(scores, topk, num_groups, group_topk, default_compute_topk)
                if trace.mode is not None and trace._current is not None:
                    own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)[1]
                    # A copy on the CPU: the forward may reuse its index buffers.
                    used[(trace.mode, trace._current, layer)] = (indices.detach().to("cpu", copy=True),
                                                                 own.detach().to("cpu", copy=True))
                return probs, indices

            return topk

        routing.RouterTrace._make_topk = probed

    def compare(self, batches, trace, mode: str) -> dict:
        """Over the (token, MoE layer) routes of `mode`'s forward: on the tokens the engine routed,
        how many experts the forward USED differ from the engine's, and how many of its OWN choices
        do; on the tokens the engine never ran, how many kept the forward's own choice."""
        used_differ = own_differ = total = unrouted_kept = unrouted = 0
        for index in range(len(batches)):
            targets, mask = trace._rollout[index]
            mask = mask.cpu()
            for layer, moe_layer in enumerate(trace._moe_layer):
                used, own = (routes.sort(dim=-1).values for routes in self.used[(mode, index, layer)])
                engine = targets[:, moe_layer].long().cpu().sort(dim=-1).values
                used_differ += int((~(used == engine).all(dim=-1) & mask).sum())
                own_differ += int((~(own == engine).all(dim=-1) & mask).sum())
                total += int(mask.sum())
                unrouted_kept += int(((used == own).all(dim=-1) & ~mask).sum())
                unrouted += int((~mask).sum())
        return {"used_differ": used_differ, "own_differ": own_differ, "total": total,
                "unrouted_kept": unrouted_kept, "unrouted": unrouted}


def perturb_routers(module: torch.nn.Module, scale: float = 0.5, seed: int = 0) -> None:
    """Move every router's weights by `scale` of their spread in seeded noise (drawn on the CPU, so
    the same on any device), so that the trainer's own choice differs from the engine's on some tokens."""
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed)
        for name, param in module.named_parameters():
            if name.endswith("router.weight"):
                noise = torch.randn(param.shape, generator=generator).to(param.device, param.dtype)
                param.add_(scale * param.float().std().to(param.dtype) * noise)
