"""Process-group start-up from the launcher's environment, and Megatron parallel state.

Rank information comes from torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or,
when a job step is started directly by `srun`, from SLURM (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID, the first host of SLURM_JOB_NODELIST). A single process with neither gets a world of
one on localhost. The backend follows the device: NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_rl.config import ConfigError, ParallelConfig


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "single"


def read_launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            rank=_int(env, "RANK"),
            world_size=_int(env, "WORLD_SIZE"),
            local_rank=_int(env, "LOCAL_RANK", default=0),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT", default=29500),
            source="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        return LaunchEnv(
            rank=_int(env, "SLURM_PROCID"),
            world_size=_int(env, "SLURM_NTASKS"),
            local_rank=_int(env, "SLURM_LOCALID", default=0),
            master_addr=env.get("MASTER_ADDR") or first_slurm_host(nodelist) or "127.0.0.1",
            master_port=_int(env, "MASTER_PORT", default=29500),
            source="slurm",
        )
    return LaunchEnv(0, 1, 0, "127.0.0.1", _int(env, "MASTER_PORT", default=0) or free_port(), "single")


def _int(env, key: str, default: int | None = None) -> int:
    if key not in env:
        if default is None:
            raise ConfigError(f"environment variable {key} is required by the launcher but unset")
        return default
    try:
        return int(env[key])
    except ValueError:
        raise ConfigError(f"environment variable {key}={env[key]!r} is not an integer") from None


def first_slurm_host(nodelist: str) -> str | None:
    """First host name of a SLURM node list such as 'gpu[003-005,9],cpu1'."""
    if not nodelist:
        return None
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not match:
        return None
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def resolve_device(requested: str) -> torch.device:
    if requested == "cpu":
        return torch.device("cpu")
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device: cuda was requested but no CUDA device is available; use device: cpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def init_process_group(device: torch.device, env: LaunchEnv, timeout_s: int = 600) -> None:
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(env.local_rank)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def init_model_parallel(parallel: ParallelConfig, world_size: int) -> None:
    """Megatron parallel state for the layout (dp derived from the world size)."""
    from megatron.core import parallel_state

    parallel.validate_world_size(world_size)
    if parallel.cp > 1 and not torch.cuda.is_available():
        raise ConfigError(
            "parallel.cp > 1 needs Transformer Engine attention (CUDA); it cannot run on CPU"
        )
    parallel_state.initialize_model_parallel(
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
