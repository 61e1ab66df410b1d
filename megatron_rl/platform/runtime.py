"""Start and stop everything a rank needs before a model can be built.

    runtime = start_runtime(config)   # device, CPU layer if CPU, process groups, parallel state, seeds
    ...
    runtime.shutdown()
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from megatron_rl.config import RunConfig
from megatron_rl.platform import cpu_compat
from megatron_rl.platform.distributed import (
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

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def is_main(self) -> bool:
        return self.launch.rank == 0

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
    )
