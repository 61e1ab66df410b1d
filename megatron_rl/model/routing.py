"""MoE routing across the two forwards of an RL update: record, replay, and measure the drift.

The old-policy logprobs and the training forward run the same tokens through the same weights
(before the update), yet an MoE router may pick different experts for some tokens, so the ratio
compares two different networks. Routing replay (as in Megatron-Core's router replay and the
"R2/R3" recipes) records the top-k experts of every token in the old-logprob forward and forces
them in the training forward. The drift metric counts the tokens whose top-k set changed.

    trace = RouterTrace.attach()            # None for dense models
    trace.start("record")                   # old-logprob forward, micro-batch by micro-batch
    policy.logprobs(batches, routing=trace)
    trace.start("replay" | "compare")       # training forward on the SAME micro-batches
    policy.train_step(batches, loss_fn, routing=trace)
    trace.drift()                           # fraction of (token, layer) routes that changed

Micro-batches are matched by index, so both passes must pack the samples identically (the
trainer packs each update's mini-batch once and uses it for both). Routes are kept per layer
as [tokens, k] index tensors on this rank (with sequence parallelism, its slice of tokens).

Hooks: Megatron-Core gives each router a `RouterReplay` object when the model is built with
`moe_enable_routing_replay` (the builder always sets it for MoE); its `get_replay_topk` is the
one place where top-k is chosen. We wrap it per instance, so the fresh top-k is always computed
(for the drift) and replaced by the recorded one only in "replay" mode.
"""

from __future__ import annotations

from typing import Literal

import torch

Mode = Literal["record", "replay", "compare"]


class RouterTrace:
    def __init__(self, routers: list):
        self.routers = routers
        self.mode: Mode | None = None
        self._recorded: dict[int, list[torch.Tensor]] = {}
        self._current: int | None = None
        self._offset = 0
        self._changed = 0
        self._total = 0
        for layer, router in enumerate(routers):
            router.get_replay_topk = self._make_topk(layer, router.get_replay_topk)

    @classmethod
    def attach(cls) -> RouterTrace | None:
        """The trace for the model built in this process, or None when it has no MoE router."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        routers = list(RouterReplay.global_router_replay_instances)
        return cls(routers) if routers else None

    def start(self, mode: Mode, offset: int = 0) -> None:
        """`offset`: index of this pass's first micro-batch among the recorded ones (a step's
        old-logprob forward records all its mini-batches in one pass; each update replays its own).
        Drift counts accumulate from one "record" to the next."""
        if mode == "record":
            self._recorded, self._changed, self._total = {}, 0, 0
        elif not self._recorded:
            raise RuntimeError(f"RouterTrace.start({mode!r}) needs a recorded forward first")
        self.mode, self._offset = mode, offset

    def stop(self) -> None:
        self.mode = None

    def drift(self) -> float | None:
        """Fraction of (token, MoE layer) pairs whose top-k expert set differed from the recording."""
        return self._changed / self._total if self._total else None

    def recorded_routes(self, microbatch: int) -> list[torch.Tensor]:
        """The recorded [tokens, k] expert indices of one micro-batch, one tensor per MoE layer."""
        return list(self._recorded[microbatch])

    def counts(self) -> tuple[int, int]:
        """(changed, total) (token, MoE layer) routes since the last recording."""
        return self._changed, self._total

    # ---- called by Policy._run around each micro-batch's forward -------------------------------

    def begin_microbatch(self, index: int) -> None:
        index = self._current = self._offset + index
        if self.mode == "record":
            self._recorded[index] = [None] * len(self.routers)
        elif self.mode is not None and index not in self._recorded:
            raise RuntimeError(f"no recorded routes for micro-batch {index}: pack both passes identically")

    def end_microbatch(self, index: int) -> None:
        self._current = None

    # ---- the wrapped top-k ------------------------------------------------------------------

    def _make_topk(self, layer: int, original):
        def topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if self.mode is None or self._current is None:
                return original(scores, topk, num_groups=num_groups, group_topk=group_topk,
                                default_compute_topk=default_compute_topk)
            probs, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            if self.mode == "record":
                self._recorded[self._current][layer] = indices.detach().clone()
                return probs, indices
            target = self._recorded[self._current][layer]
            if target is None or target.shape != indices.shape:
                raise RuntimeError(f"MoE layer {layer}: recorded routes do not match this micro-batch's tokens")
            target = target.to(indices.device)
            same = (indices.sort(dim=-1).values == target.sort(dim=-1).values).all(dim=-1)
            self._changed += int((~same).sum())
            self._total += same.numel()
            if self.mode == "replay":
                # As Megatron-Core's own replay: the recorded experts, weighted by this forward's scores.
                return scores.gather(1, target), target
            return probs, indices

        return topk
