"""Start and stop everything a rank needs before a model can be built, and what a rank asks
about its place in the job.

    runtime = start_runtime(config)   # device, CPU layer if CPU, process groups, parallel state, seeds
    runtime.is_driver                 # global rank 0: scores, logs, reports
    runtime.from_driver(obj)          # the driver's object on every rank
    runtime.from_last_stage(obj)      # a last pipeline stage's object on every rank
    runtime.any_rank(flag)            # True on every rank when any rank passes True
    runtime.barrier()
    runtime.shutdown()

The trainer asks its topology here, never Megatron's parallel state directly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.config import RunConfig
from megatron_rl.runtime.cpu import megatron_patches as cpu_compat
from megatron_rl.runtime.distributed import (
    LaunchEnv,
    destroy,
    init_model_parallel,
    init_process_group,
    read_launch_env,
    resolve_device,
)


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    launch: LaunchEnv
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    dp_size: int
    pp_size: int = 1

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def is_driver(self) -> bool:
        """Global rank 0: the rank that scores, logs and reports."""
        return self.launch.rank == 0

    @property
    def is_last_stage(self) -> bool:
        """On the last pipeline stage: the ranks that compute logprobs and the loss."""
        return self.pp_rank == self.pp_size - 1

    def from_driver(self, obj):
        """Collective: the driver's `obj` (picklable) on every rank; other ranks pass anything."""
        holder = [obj]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def from_last_stage(self, obj):
        """Collective: the `obj` of a last-stage rank on every rank (metrics reduced where the loss
        runs, delivered to the driver, which logs them). Without pipeline parallelism every rank
        is on the last stage and keeps its own."""
        if self.pp_size == 1:
            return obj
        source = dist.get_world_size() - 1  # a last-stage rank: Megatron puts the last stage at the end
        holder = [obj if dist.get_rank() == source else None]
        dist.broadcast_object_list(holder, src=source)
        return holder[0]

    def barrier(self) -> None:
        dist.barrier()

    def any_rank(self, flag: bool) -> bool:
        """Collective: whether any rank passed True."""
        value = torch.tensor(1 if flag else 0, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(int(value))

    def shutdown(self) -> None:
        destroy()


def start_runtime(config: RunConfig) -> Runtime:
    from megatron.core import parallel_state, tensor_parallel

    device = resolve_device(config.device)
    launch = read_launch_env()
    # Cheap layout checks first, before any process group or import-heavy work.
    config.parallel.validate_world_size(launch.world_size)
    if device.type == "cpu":
        cpu_compat.activate()
    init_process_group(device, launch)
    init_model_parallel(config.parallel, launch.world_size)

    # Same seeds on every rank for python/numpy/torch; Megatron derives per-TP/EP-rank streams
    # for weight init and dropout from the same seed.
    random.seed(config.seed)
    np.random.seed(config.seed)
    torch.manual_seed(config.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(config.seed)

    return Runtime(
        device=device,
        launch=launch,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
    )
