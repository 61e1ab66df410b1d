"""MoE routing across one RL step's forwards, as rl.routing_replay says, behind one object.

    routing = RoutingReplay.attach(config.rl.routing_replay, policy, runtime)   # every model
    routing.begin_step(packed, minibatches, recompute_old=...)   # R3: the engine's routes, loaded once
    with routing.old_forward() as trace:        policy.logprobs(..., routing=trace)
    with routing.reference_forward() as trace:  policy.logprobs(..., routing=trace)
    with routing.update(offset) as trace:       policy.train_step(..., routing=trace)
    metrics.update(routing.drift_metrics())      # collective under R3

Each phase yields the model's RouterTrace (model/routing.py) set to what that forward does, or
None where the forward routes by itself (dense models always):

| rl.routing_replay | old-logprob forward | reference forward | each update |
| --- | --- | --- | --- |
| off      | records its routes | routes itself | compares its routes with the record (`moe/routing_drift`) |
| training | records its routes | routes itself | replays the record |
| rollout (R3) | replays the engine's routes | replays the engine's routes | replays the engine's routes |

With one update per rollout the old policy is the updated one (its logprobs come from the
update's own forward), so off / training record and compare nothing. Under R3,
`moe/routing_drift` counts the training forwards' own choices that differ from the engine's and
`moe/rollout_routing_drift` the same at the engine's weights.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_rl.model.routing import RouterTrace


class RoutingReplay:
    def __init__(self, trace: RouterTrace | None, mode: str, policy, runtime):
        self.trace, self.mode, self.policy, self.runtime = trace, mode, policy, runtime
        self.recompute_old = False

    @classmethod
    def attach(cls, mode: str, policy, runtime) -> RoutingReplay:
        """For the model built in this process (`mode`: rl.routing_replay)."""
        return cls(RouterTrace.attach(), mode, policy, runtime)

    @property
    def engine_routes(self) -> bool:
        return self.mode == "rollout"

    def begin_step(self, packed, minibatches, *, recompute_old: bool) -> None:
        """A new step: its packed micro-batches per update and the trajectories they index.
        `recompute_old`: the step runs an old-logprob forward (more than one update)."""
        self.recompute_old = recompute_old
        if self.trace is None:
            return
        if self.engine_routes:
            self.trace.load_rollout_routes(packed, minibatches, self.policy.module, self.policy.arch.moe_layer_pattern)
            self.trace.reset_counts("rollout")
            self.trace.reset_counts()

    @contextmanager
    def old_forward(self) -> Iterator[RouterTrace | None]:
        """The old-logprob forward: records its routes, or under R3 runs on the engine's and
        counts those the policy, holding the engine's weights, would have chosen otherwise."""
        if self.trace is None:
            yield None
            return
        if self.engine_routes:
            self.trace.start("rollout", counter="rollout")
        else:
            self.trace.start("record")
        yield self.trace
        self.trace.stop()

    @contextmanager
    def reference_forward(self) -> Iterator[RouterTrace | None]:
        """The reference policy's forward: on the engine's routes under R3, else its own."""
        if self.trace is None or not self.engine_routes:
            yield None
            return
        self.trace.start("rollout", counter=None)
        yield self.trace
        self.trace.stop()

    @contextmanager
    def update(self, offset: int) -> Iterator[RouterTrace | None]:
        """One optimizer update's forward; `offset`: its first micro-batch's index in the step."""
        if self.trace is None:
            yield None
            return
        if self.engine_routes:
            self.trace.start("rollout", offset=offset)
        elif self.recompute_old:
            self.trace.start("replay" if self.mode == "training" else "compare", offset=offset)
        else:
            yield None
            return
        yield self.trace
        self.trace.stop()

    def drift_metrics(self) -> dict:
        """The step's routing drift (see the module docstring). Collective under R3: over all
        ranks, since each routes its own tokens and, with pipeline parallelism, its own layers."""
        if self.engine_routes:
            none = (0, 0)
            drift = self.trace.counts() if self.trace is not None else none
            at_engine = drift if not self.recompute_old else (
                self.trace.counts("rollout") if self.trace is not None else none)
            counts = torch.tensor([*drift, *at_engine], dtype=torch.float64, device=self.runtime.device)
            dist.all_reduce(counts)
            metrics = {}
            if counts[1]:
                metrics["moe/routing_drift"] = float(counts[0] / counts[1])
            if counts[3]:
                metrics["moe/rollout_routing_drift"] = float(counts[2] / counts[3])
            return metrics
        if self.trace is not None and self.recompute_old:
            changed, total = self.trace.counts()
            if total:
                return {"moe/routing_drift": changed / total}
        return {}
