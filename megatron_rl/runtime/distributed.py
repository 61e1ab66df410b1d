"""Process-group start-up from the launcher's environment, and Megatron parallel state.

Rank information comes from torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or,
when a job step is started directly by `srun`, from SLURM (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID, the first host of SLURM_JOB_NODELIST). A single process with neither gets a world of
one on localhost. The backend follows the device: NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_rl.config import ParallelConfig

from megatron_rl.errors import ConfigError
from megatron_rl.runtime.launch_env import LaunchEnv, first_slurm_host, free_port, read_launch_env  # noqa: F401
from megatron_rl.runtime.rendezvous import store_server


def resolve_device(requested: str) -> torch.device:
    if requested == "cpu":
        return torch.device("cpu")
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device: cuda was requested but no CUDA device is available; use device: cpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def init_process_group(device: torch.device, env: LaunchEnv, timeout_s: int = 600) -> None:
    """Under torchrun the ranks join torchrun's own store (started by megatron_rl.runtime.torchrun,
    it listens on MASTER_ADDR only); otherwise rank 0 hosts the store, listening on the address the
    other ranks reach it at (runtime/rendezvous.py), never on every interface."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(env.local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        dist.init_process_group(backend=backend, init_method=f"tcp://{env.master_addr}:{env.master_port}",
                                rank=env.rank, world_size=env.world_size, timeout=timeout)
        return
    if env.rank == 0:
        store = store_server(env.master_addr, env.master_port, world_size=env.world_size, timeout_s=timeout_s)
    else:
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, False, timeout)
    dist.init_process_group(backend=backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)


def init_model_parallel(parallel: ParallelConfig, world_size: int) -> None:
    """Megatron parallel state for the layout (dp derived from the world size)."""
    from megatron.core import parallel_state

    parallel.validate_world_size(world_size)
    if parallel.cp > 1 and not torch.cuda.is_available():
        raise ConfigError(
            "parallel.cp > 1 needs Transformer Engine attention (CUDA); it cannot run on CPU"
        )
    parallel_state.initialize_model_parallel(**megatron_parallel_sizes(parallel))


def megatron_parallel_sizes(parallel: ParallelConfig) -> dict:
    """The layout as Megatron-Core's initialize_model_parallel takes it."""
    return dict(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp,
    )


def destroy() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
