"""Who am I in the job: rank, world size and rendezvous address from the launcher's environment.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; a job step started directly
by `srun` has SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and the node list (the first host is the
rendezvous); a single process with neither gets a world of one on localhost. No torch import:
the configuration checks that run before any expensive start-up use this.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

from megatron_rl.errors import ConfigError


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
