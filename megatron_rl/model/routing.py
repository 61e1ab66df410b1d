"""MoE routing across the forwards of an RL update: record, replay, and measure the drift.

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

R3 (`rl.routing_replay: rollout`, rollout routing replay) replays the ROLLOUT ENGINE's routes
instead: every token the engine ran a forward on carries the engine's top-k per MoE layer
(`Trajectory.routed_experts`, [prompt + response - 1, MoE layers, k], see
megatron_rl/rollout/worker/route_capture.py), and the old-logprob, reference and training forwards
all use them, so the trainer computes the network the engine sampled from:

    trace.load_rollout_routes(packed, trajectories, model, moe_layer_pattern)
    trace.start("rollout", offset, counter="rollout")   # counts own choice != engine's
    policy.logprobs(batches, routing=trace)

Tokens the engine never ran (each sample's last token, padding, filler micro-batches) keep the
trainer's own choice. The engine's routes are numbered by MoE layer over the whole model; each
router here is mapped to its MoE layer through its global layer number (pipeline stages hold
only their own layers), and with sequence parallelism a router sees its rank's contiguous slice
of the packed row.

Hooks: Megatron-Core gives each router a `RouterReplay` object when the model is built with
`moe_enable_routing_replay` (the builder always sets it for MoE); its `get_replay_topk` is the
one place where top-k is chosen. We wrap it per instance, so the fresh top-k is always computed
(for the drift) and replaced by the recorded one only in "replay" mode (the engine's in
"rollout" mode).
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch

Mode = Literal["record", "replay", "compare", "rollout"]


class RouterTrace:
    def __init__(self, routers: list):
        self.routers = routers
        self.mode: Mode | None = None
        self._recorded: dict[int, list[torch.Tensor]] = {}
        self._current: int | None = None
        self._offset = 0
        self._changed = 0
        self._total = 0
        # R3: per micro-batch, the engine's routes of the packed row [T, MoE layers, k] and which
        # of its tokens the engine routed [T]; the MoE layer (over the model) of each router here.
        self._rollout: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._moe_layer: list[int] | None = None
        self._counter: str | None = "drift"
        self._counts: dict[str, list[int]] = {}
        for layer, router in enumerate(routers):
            router.get_replay_topk = self._make_topk(layer, router.get_replay_topk)

    @classmethod
    def attach(cls) -> RouterTrace | None:
        """The trace for the model built in this process, or None when it has no MoE router."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        routers = list(RouterReplay.global_router_replay_instances)
        return cls(routers) if routers else None

    def start(self, mode: Mode, offset: int = 0, counter: str | None = "drift") -> None:
        """`offset`: index of this pass's first micro-batch among the recorded ones (a step's
        old-logprob forward records all its mini-batches in one pass; each update replays its own).
        Drift counts accumulate from one "record" to the next. "rollout" replays the routes of
        `load_rollout_routes`; `counter` names where its (changed, total) counts go (None: not
        counted; "drift": with the replay/compare counts; reset with `reset_counts`)."""
        if mode == "record":
            self._recorded, self._changed, self._total = {}, 0, 0
        elif mode == "rollout":
            if self._rollout is None:
                raise RuntimeError("RouterTrace.start('rollout') needs load_rollout_routes first")
        elif not self._recorded:
            raise RuntimeError(f"RouterTrace.start({mode!r}) needs a recorded forward first")
        self.mode, self._offset = mode, offset
        self._counter = "drift" if mode != "rollout" else counter

    def stop(self) -> None:
        self.mode = None

    def drift(self) -> float | None:
        """Fraction of (token, MoE layer) pairs whose top-k expert set differed from the recording."""
        return self._changed / self._total if self._total else None

    def recorded_routes(self, microbatch: int) -> list[torch.Tensor]:
        """The recorded [tokens, k] expert indices of one micro-batch, one tensor per MoE layer."""
        return list(self._recorded[microbatch])

    def counts(self, counter: str = "drift") -> tuple[int, int]:
        """(changed, total) (token, MoE layer) routes: "drift" since the last recording (or reset);
        another counter since its reset."""
        if counter == "drift":
            return self._changed, self._total
        changed, total = self._counts.get(counter, (0, 0))
        return changed, total

    def reset_counts(self, counter: str = "drift") -> None:
        if counter == "drift":
            self._changed, self._total = 0, 0
        else:
            self._counts[counter] = [0, 0]

    # ---- R3: the rollout engine's routes ----------------------------------------------------

    def load_rollout_routes(self, packed: Sequence[Sequence], trajectories: Sequence[Sequence], model,
                            moe_layer_pattern: Sequence[bool]) -> int:
        """Build each micro-batch's replay targets from the samples' engine routes.

        `packed[u]`: update u's PackedBatches; `trajectories[u]`: the samples they index
        (batch.sample_ids), each with `routed_experts` ([prompt + response - 1, MoE layers, k] or
        None). Micro-batches are numbered across updates as the trainer's passes number them
        (offset = micro-batches of the earlier updates). Returns the number of routed tokens."""
        self._bind_layers(model, moe_layer_pattern)
        layers = sum(bool(flag) for flag in moe_layer_pattern)
        self._rollout, index, routed = {}, 0, 0
        for batches, samples in zip(packed, trajectories):
            for batch in batches:
                entry = rollout_targets(batch, samples, layers)
                if entry is not None:
                    self._rollout[index] = entry
                    routed += int(entry[1].sum())
                index += 1
        return routed

    def _bind_layers(self, model, moe_layer_pattern: Sequence[bool]) -> None:
        """Each router's MoE layer over the whole model, from its global (1-based) layer number."""
        if self._moe_layer is not None:
            return
        numbers = {}
        for module in model.modules():
            replay = getattr(module, "router_replay", None)
            if replay is None or not hasattr(module, "layer_number"):
                continue
            replay = getattr(replay, "replay", replay)  # moe_router._DeepSeekTopk wraps the RouterReplay
            numbers[id(replay)] = module.layer_number
        moe_layer = []
        for router in self.routers:
            number = numbers.get(id(router))
            if number is None or not 1 <= number <= len(moe_layer_pattern) or not moe_layer_pattern[number - 1]:
                raise RuntimeError(f"RouterTrace: a router has layer number {number}, not an MoE layer of the model")
            moe_layer.append(sum(bool(flag) for flag in moe_layer_pattern[: number - 1]))
        self._moe_layer = moe_layer

    # ---- called by Policy._run around each micro-batch's forward -------------------------------

    def begin_microbatch(self, index: int) -> None:
        index = self._current = self._offset + index
        if self.mode == "record":
            self._recorded[index] = [None] * len(self.routers)
        elif self.mode == "rollout":
            return  # a micro-batch without engine routes (a DP filler) routes by itself
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
            if self.mode == "rollout":
                return self._rollout_topk(layer, scores, probs, indices)
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

    def _rollout_topk(self, layer: int, scores: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor):
        """The engine's experts for the tokens it routed, this forward's own for the others."""
        entry = self._rollout.get(self._current)
        if entry is None:
            return probs, indices
        targets, mask = entry
        rows = _local_rows(targets.shape[0], indices.shape[0], layer)
        target = targets[rows, self._moe_layer[layer]].to(device=indices.device, dtype=indices.dtype)
        routed = mask[rows].to(indices.device)
        if target.shape != indices.shape:
            raise RuntimeError(f"MoE layer {layer}: the engine routed {target.shape[1]} experts per token, "
                               f"this router {indices.shape[1]}")
        if self._counter is not None:
            same = (indices.sort(dim=-1).values == target.sort(dim=-1).values).all(dim=-1)
            changed, total = int((~same & routed).sum()), int(routed.sum())
            if self._counter == "drift":
                self._changed, self._total = self._changed + changed, self._total + total
            else:
                counts = self._counts.setdefault(self._counter, [0, 0])
                counts[0], counts[1] = counts[0] + changed, counts[1] + total
        chosen = torch.where(routed.unsqueeze(-1), target, indices)
        # As Megatron-Core's replay: the engine's experts, weighted by this forward's scores.
        return torch.where(routed.unsqueeze(-1), scores.gather(1, chosen), probs), chosen


def rollout_targets(batch, samples: Sequence, layers: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """([T, layers, k] engine expert ids, [T] bool routed) for one packed micro-batch (None when
    none of its samples carries routes).

    Sample j of the batch occupies positions start..start+length-1 of the row; the engine ran
    its first length-1 tokens (the last one is never fed back), whose routes come first in
    `routed_experts`. Padding is left to the trainer."""
    count = batch.num_tokens
    targets, mask = None, torch.zeros(count, dtype=torch.bool)
    for (start, prompt, length), sample_id in zip(batch.spans, batch.sample_ids):
        routes = getattr(samples[sample_id], "routed_experts", None)
        if routes is None:
            raise ValueError(f"sample {sample_id} carries no rollout engine routes (routed_experts): generate "
                             "with SamplingParams(return_routed_experts=True) for rl.routing_replay=rollout")
        routes = torch.as_tensor(routes)
        if routes.dim() != 3 or routes.shape[0] != length - 1 or routes.shape[1] != layers:
            raise ValueError(f"sample {sample_id}: engine routes of shape {tuple(routes.shape)}, expected "
                             f"[{length - 1} tokens, {layers} MoE layers, k]: the engine's model is not this one")
        if targets is None:
            targets = torch.zeros(count, layers, routes.shape[2], dtype=routes.dtype)
        targets[start: start + length - 1] = routes
        mask[start: start + length - 1] = True
    return None if targets is None else (targets, mask)


def _local_rows(total: int, local: int, layer: int) -> slice:
    """The rows of the packed row this router sees: all of them, or with sequence parallelism
    this tensor-parallel rank's contiguous slice."""
    if local == total:
        return slice(0, total)
    from megatron.core import parallel_state as ps

    size, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    if local * size != total:
        raise RuntimeError(f"MoE layer {layer}: the router sees {local} tokens of a {total}-token micro-batch "
                           f"at tensor parallel size {size}")
    return slice(rank * local, (rank + 1) * local)
