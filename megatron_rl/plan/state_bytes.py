"""Bytes of parameters, gradients and optimizer state on one rank, as Megatron-Core lays them out.

Given a rank's ordered parameters (plan/meta_model.py), this follows Megatron-Core 0.16's own
layout rules, with the settings model/policy.py trains with (overlap_grad_reduce off, so one
bucket per buffer; gradients reduced in fp32; Adam):

* DistributedDataParallel puts the parameters that reduce over the data-parallel group and the
  expert-parallel ones (`allreduce=False`) in separate buffers, each split by (param dtype, grad
  dtype), in model order; a buffer lays its parameters out in reverse order.
* With the distributed optimizer each parameter starts at a multiple of 64 elements and each
  bucket ends at a multiple of lcm(data-parallel size, 128), so every DP rank owns an equal
  slice; the parameters themselves then live in the buffer's padded param storage. A tied
  embedding at pp > 1 gets a bucket of its own. Without it nothing is padded.
* The gradient buffer holds fp32 gradients for every element of the buffer (padding included).
* The distributed optimizer gives DP rank r the r-th of dp equal slices of each bucket; for every
  bf16 parameter it keeps an fp32 copy of the part inside its slice (fp32 parameters are updated
  in place: no copy), and Adam keeps two fp32 moments of the same size. Without it, every rank
  keeps an fp32 copy of every bf16 parameter and both moments for all of them.

Frozen parameters (model.lora's base) sit outside the buffers: parameters only, on every rank.

Adam's per-parameter step counters (a 4-byte scalar each) are not counted. model.fp8_param
(weights kept in FP8) is not modelled: its weights are counted at params_dtype, an upper bound.
tests/plan/test_state_bytes.py compares every number with what a real run allocates, per rank.
"""

from __future__ import annotations

import dataclasses
import math

from megatron_rl.plan.meta_model import ParamEntry

GRAD_ITEMSIZE = 4  # DistributedDataParallelConfig(grad_reduce_in_fp32=True)
MAIN_ITEMSIZE = 4  # fp32 main weights
MOMENTS = 2  # Adam: exp_avg, exp_avg_sq, fp32 each


@dataclasses.dataclass(frozen=True)
class RankState:
    """Bytes one rank holds for training state."""

    params: int
    grads: int
    main_params: int  # fp32 copies of bf16 weights (this rank's shard with the distributed optimizer)
    moments: int  # Adam's two moments

    @property
    def optimizer(self) -> int:
        return self.main_params + self.moments

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def __add__(self, other: "RankState") -> "RankState":
        # Field by field, not dataclasses.astuple (which deep-copies): the planner adds millions.
        return RankState(self.params + other.params, self.grads + other.grads, self.main_params + other.main_params,
                         self.moments + other.moments)


ZERO = RankState(0, 0, 0, 0)


def _pad(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor


@dataclasses.dataclass(frozen=True)
class _Buffer:
    itemsize: int
    # (start, end) of every parameter in buffer order, and the bucket boundaries
    spans: tuple[tuple[int, int], ...]
    buckets: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return self.buckets[-1][1] if self.buckets else 0


def _layout(params: list[ParamEntry], dp: int, distributed_optimizer: bool) -> _Buffer:
    """One _ParamAndGradBuffer's element layout (overlap_grad_reduce off: no size-based buckets)."""
    divisor = math.lcm(dp, 128)
    spans, buckets = [], []
    start = bucket_start = 0
    open_bucket = False
    for param in reversed(params):
        if distributed_optimizer:
            start = _pad(start, 64)
        own_bucket = param.shared_embedding and distributed_optimizer
        if own_bucket and open_bucket:
            end = _pad(start, divisor)
            buckets.append((bucket_start, end))
            start = bucket_start = end
        spans.append((start, start + param.numel))
        open_bucket = True
        start += param.numel
        if own_bucket:
            end = _pad(start, divisor)
            buckets.append((bucket_start, end))
            start = bucket_start = end
            open_bucket = False
    if open_bucket:
        end = _pad(start, divisor) if distributed_optimizer else start
        buckets.append((bucket_start, end))
    itemsize = params[0].itemsize if params else 0
    return _Buffer(itemsize, tuple(spans), tuple(buckets))


def _owned_per_rank(buffer: _Buffer, dp: int) -> list[int]:
    """Parameter elements inside each DP rank's slice of the buffer's buckets (padding excluded):
    a slice's size minus the padding gaps that fall in it, so O(parameters + dp)."""
    owned = [0] * dp
    spans = iter(buffer.spans)
    span = next(spans, None)
    for bucket_start, bucket_end in buffer.buckets:
        size = (bucket_end - bucket_start) // dp
        owned = [o + size for o in owned]
        cursor = bucket_start
        gaps = []
        while span is not None and span[1] <= bucket_end:
            gaps.append((cursor, span[0]))
            cursor = span[1]
            span = next(spans, None)
        gaps.append((cursor, bucket_end))
        for lo, hi in gaps:
            while lo < hi:  # a gap can straddle slice boundaries
                rank = (lo - bucket_start) // size
                top = min(hi, bucket_start + (rank + 1) * size)
                owned[rank] -= top - lo
                lo = top
    return owned


def buffer_groups(params: list[ParamEntry]) -> dict[tuple[bool, int], list[ParamEntry]]:
    """DDP's buffers: (expert-parallel, param itemsize) -> parameters in model order."""
    groups: dict[tuple[bool, int], list[ParamEntry]] = {}
    for param in params:
        groups.setdefault((param.expert, param.itemsize), []).append(param)
    return groups


def _part_states(params: list[ParamEntry], size: int, distributed_optimizer: bool) -> list[RankState]:
    """Per DP rank (of `size`), the bytes of the buffers holding `params` (one kind: dense or expert)."""
    states = [ZERO] * size
    for (_, itemsize), group in buffer_groups(params).items():
        buffer = _layout(group, size, distributed_optimizer)
        if distributed_optimizer:
            param_bytes, owned = buffer.numel * itemsize, _owned_per_rank(buffer, size)
        else:
            param_bytes, owned = sum(p.numel for p in group) * itemsize, [sum(p.numel for p in group)] * size
        main = MAIN_ITEMSIZE if itemsize < MAIN_ITEMSIZE else 0
        states = [state + RankState(param_bytes, buffer.numel * GRAD_ITEMSIZE, n * main, n * MAIN_ITEMSIZE * MOMENTS)
                  for state, n in zip(states, owned)]
    return states


@dataclasses.dataclass(frozen=True)
class StageStates:
    """A pipeline stage's bytes per dense-DP rank and per expert-DP rank; a rank holds one of each."""

    dense: list[RankState]
    expert: list[RankState]

    def rank(self, dp_rank: int, expert_dp_rank: int) -> RankState:
        return self.dense[dp_rank] + self.expert[expert_dp_rank]

    def worst(self) -> RankState:
        """The largest dense share plus the largest expert share: the DP slices differ only in
        where the padding falls, so this bounds every rank (exact when one rank holds both)."""
        return max(self.dense, key=lambda s: s.total) + max(self.expert, key=lambda s: s.total)


def stage_states(params: list[ParamEntry], *, dp: int, expert_dp: int, distributed_optimizer: bool) -> StageStates:
    """Bytes of the ranks of the stage holding `params`, by their DP ranks over the data-parallel
    group (`dp`, with context parallelism) and the expert-data-parallel group (`expert_dp`).
    Frozen parameters (the base under model.lora) are in no DDP buffer: each rank holds them
    whole, as parameters only."""
    trained = [p for p in params if not p.frozen]
    dense = [p for p in trained if not p.expert]
    expert = [p for p in trained if p.expert]

    frozen = {False: 0, True: 0}
    for p in params:
        if p.frozen:
            frozen[p.expert] += p.numel * p.itemsize
    dense_frozen, expert_frozen = RankState(frozen[False], 0, 0, 0), RankState(frozen[True], 0, 0, 0)
    return StageStates([s + dense_frozen for s in _part_states(dense, dp, distributed_optimizer)],
                       [s + expert_frozen for s in _part_states(expert, expert_dp, distributed_optimizer)])
