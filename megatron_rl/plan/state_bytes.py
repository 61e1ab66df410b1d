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
from operator import attrgetter

import numpy as np

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
    # Every parameter's first element and element count, in buffer order (int64 arrays: a 256-GPU
    # DeepSeek-V3 search lays out thousands of stages of thousands of parameters, which element by
    # element in Python took most of its time), and the bucket boundaries.
    starts: np.ndarray
    numels: np.ndarray
    buckets: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return self.buckets[-1][1] if self.buckets else 0


@dataclasses.dataclass(frozen=True)
class _Columns:
    """A stage's parameters as arrays, in model order: read once per stage with C-level passes
    (map over attrgetter), not attribute by attribute in Python."""

    numel: np.ndarray
    itemsize: np.ndarray
    expert: np.ndarray
    shared_embedding: np.ndarray
    frozen: np.ndarray

    @classmethod
    def of(cls, params: list[ParamEntry]) -> "_Columns":
        def column(name: str, dtype) -> np.ndarray:
            return np.fromiter(map(attrgetter(name), params), dtype=dtype, count=len(params))

        return cls(column("numel", np.int64), column("itemsize", np.int64), column("expert", bool),
                   column("shared_embedding", bool), column("frozen", bool))


def _layout(numels: np.ndarray, shared_embedding: np.ndarray, itemsize: int, dp: int,
            distributed_optimizer: bool) -> _Buffer:
    """One _ParamAndGradBuffer's element layout (overlap_grad_reduce off: no size-based buckets).
    In buffer order (the parameters reversed) each parameter starts where the previous one ends,
    padded to 64 elements with the distributed optimizer; a tied embedding at pp > 1 (at most one
    per stage and buffer) closes the bucket before it and gets one of its own. Between those, a
    run of parameters is laid out at once: from a start padded to 64, each next start is the
    previous one plus its size padded to 64. `numels`, `shared_embedding`: the buffer's parameters
    in model order."""
    divisor = math.lcm(dp, 128)
    numels = numels[::-1]
    count = len(numels)
    starts = np.empty_like(numels)
    own = np.flatnonzero(shared_embedding[::-1]).tolist() if distributed_optimizer else []
    buckets = []
    start = bucket_start = 0
    open_bucket = False
    run_start = 0
    for run_end in [*own, count]:
        if run_start < run_end:  # ordinary parameters run_start .. run_end - 1
            run = numels[run_start:run_end]
            first = _pad(start, 64) if distributed_optimizer else start
            steps = -(-run // 64) * 64 if distributed_optimizer else run
            starts[run_start] = first
            np.cumsum(steps[:-1], out=starts[run_start + 1:run_end])
            starts[run_start + 1:run_end] += first
            start = int(starts[run_end - 1] + run[-1])
            open_bucket = True
        if run_end == count:
            break
        start = _pad(start, 64)  # a parameter with a bucket of its own
        if open_bucket:
            end = _pad(start, divisor)
            buckets.append((bucket_start, end))
            start = bucket_start = end
        starts[run_end] = start
        start = _pad(start + int(numels[run_end]), divisor)
        buckets.append((bucket_start, start))
        bucket_start = start
        open_bucket = False
        run_start = run_end + 1
    if open_bucket:
        end = _pad(start, divisor) if distributed_optimizer else start
        buckets.append((bucket_start, end))
    return _Buffer(itemsize, starts, numels, tuple(buckets))


def _owned_per_rank(buffer: _Buffer, dp: int) -> np.ndarray:
    """Parameter elements inside each DP rank's slice of the buffer's buckets (padding excluded):
    the parameter elements below the slice's end minus those below its start, each a binary search
    over the parameters' starts, so O(parameters + dp log parameters)."""
    before = np.zeros(len(buffer.numels) + 1, dtype=np.int64)  # elements of the parameters before each
    np.cumsum(buffer.numels, out=before[1:])
    owned = np.zeros(dp, dtype=np.int64)
    for bucket_start, bucket_end in buffer.buckets:
        size = (bucket_end - bucket_start) // dp
        bounds = bucket_start + size * np.arange(dp + 1, dtype=np.int64)
        last = np.searchsorted(buffer.starts, bounds, side="right") - 1  # the last parameter starting at or below
        index = np.maximum(last, 0)
        below = before[index] + np.clip(bounds - buffer.starts[index], 0, buffer.numels[index])
        owned += np.diff(np.where(last >= 0, below, 0))
    return owned


def _part_states(columns: _Columns, expert: bool, size: int, distributed_optimizer: bool) -> np.ndarray:
    """Per DP rank (of `size`), the bytes (params, grads, main_params, moments: one row per rank) of
    the buffers holding the trained parameters of one kind (dense or `expert`): one buffer per
    param itemsize, its parameters in model order."""
    kind = ~columns.frozen & (columns.expert == expert)
    states = np.zeros((size, 4), dtype=np.int64)
    for itemsize in np.unique(columns.itemsize[kind]).tolist():
        member = kind & (columns.itemsize == itemsize)
        buffer = _layout(columns.numel[member], columns.shared_embedding[member], itemsize, size,
                         distributed_optimizer)
        owned = _owned_per_rank(buffer, size) if distributed_optimizer else buffer.numel
        main = MAIN_ITEMSIZE if itemsize < MAIN_ITEMSIZE else 0
        states[:, 0] += buffer.numel * itemsize
        states[:, 1] += buffer.numel * GRAD_ITEMSIZE
        states[:, 2] += owned * main
        states[:, 3] += owned * MAIN_ITEMSIZE * MOMENTS
    return states


@dataclasses.dataclass(frozen=True)
class StageStates:
    """A pipeline stage's bytes per dense-DP rank and per expert-DP rank; a rank holds one of each.
    `dense`, `expert`: one row per DP rank of (params, grads, main_params, moments), int64 (a
    512-GPU search has thousands of stages of up to 512 ranks: RankState objects for every one of
    them took most of its time)."""

    dense: np.ndarray
    expert: np.ndarray

    def rank(self, dp_rank: int, expert_dp_rank: int) -> RankState:
        return RankState(*(self.dense[dp_rank] + self.expert[expert_dp_rank]).tolist())

    def worst(self) -> RankState:
        """The largest dense share plus the largest expert share: the DP slices differ only in
        where the padding falls, so this bounds every rank (exact when one rank holds both).
        (The first of equal ones, as max() picks.)"""
        dense, expert = (rows[int(np.argmax(rows.sum(axis=1)))] for rows in (self.dense, self.expert))
        return RankState(*(dense + expert).tolist())


def stage_states(params: list[ParamEntry], *, dp: int, expert_dp: int, distributed_optimizer: bool) -> StageStates:
    """Bytes of the ranks of the stage holding `params`, by their DP ranks over the data-parallel
    group (`dp`, with context parallelism) and the expert-data-parallel group (`expert_dp`).
    Frozen parameters (the base under model.lora) are in no DDP buffer: each rank holds them
    whole, as parameters only."""
    columns = _Columns.of(params)
    held = columns.numel * columns.itemsize
    dense, expert = (_part_states(columns, kind, size, distributed_optimizer)
                     for kind, size in ((False, dp), (True, expert_dp)))
    dense[:, 0] += int(held[columns.frozen & ~columns.expert].sum())
    expert[:, 0] += int(held[columns.frozen & columns.expert].sum())
    return StageStates(dense, expert)
