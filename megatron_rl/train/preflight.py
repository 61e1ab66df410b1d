"""Everything a run can check before a process group or a model exists.

`check_layout_and_paths` makes a bad run fail in well under a second: the parallel layout
against the model and the world size, and the paths the run reads or must not overwrite. It
imports no torch (that alone takes seconds), so `megatron-rl train` runs it before anything else.
`preflight` then runs the slower checks (the recipe, the run directory, the engine and wandb
installed, every reward function resolved, the datasets read) and returns the datasets it read.

The functions import what they check inside them, so that importing this module stays instant.
"""

from __future__ import annotations

from pathlib import Path

from megatron_rl.errors import ConfigError


def check_layout_and_paths(config, *, rl: bool = True) -> None:
    """`config`: a loaded RunConfig. Raises ConfigError naming the key and the reason.
    `rl=False` (`megatron-rl sft`): no rollout engine, so not its check. The run directory and
    its checkpoints are checked by megatron_rl.checkpoint.manager.check_run_directory."""
    from megatron_rl.model.hf_config import load_hf_config, parse_hf_config
    from megatron_rl.model.layout_checks import check_divisibility
    from megatron_rl.runtime.launch_env import read_launch_env

    raw, source = load_hf_config(config.model.hf_config)
    arch = parse_hf_config(raw, source)
    world = read_launch_env().world_size
    config.parallel.validate_for_model("parallel", num_experts=arch.num_experts if arch.is_moe else None)
    check_divisibility(arch, config)
    if rl and config.rl.routing_replay == "rollout" and not arch.is_moe:
        raise ConfigError(f"rl.routing_replay=rollout replays the rollout engine's MoE routes, but "
                          f"{source} is a dense model (no experts); use rl.routing_replay=off")
    config.parallel.validate_world_size(world)
    if rl and config.rollout.mode == "colocated" and arch.num_key_value_heads % world:
        raise ConfigError(
            f"rollout.mode=colocated shards the engine over all {world} ranks, which must divide the "
            f"model's {arch.num_key_value_heads} KV heads; use rollout.mode=server"
        )
    if rl and config.rollout.weight_transport == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("rollout.weight_transport=nccl needs CUDA GPUs on the trainer and the servers; "
                              "on CPU use collective (the same transport over gloo) or files")
    if rl:
        check_fp8_rollout(config)
        if engines_on_cpu(config):
            from megatron_rl.runtime.cpu.vllm_kernels import refuse_unrunnable

            refuse_unrunnable(raw, source)
    if config.checkpoint.init_from and not Path(config.checkpoint.init_from).exists():
        raise ConfigError(f"checkpoint.init_from: {config.checkpoint.init_from} does not exist")


def check_fp8_rollout(config) -> None:
    """model.export_fp8 (engines serve block-wise FP8 weights) where the engines we start would run
    on CPU: with device: cpu a colocated engine, or servers from vLLM's CPU build; with device: auto
    any engine from vLLM's CPU build. device: cuda is taken at its word (the trainer needs a GPU,
    and so a GPU build of vLLM; recipes for GPU clusters are validated on CPU machines too).

    vLLM's CPU build (0.32) has block-FP8 kernels only for CPUs with Intel AMX (Sapphire Rapids
    or newer; without AMX no kernel is found and the engine fails at start), and they repack the
    weights on load in a layout our in-place weight updates were never checked against (the CPU
    MoE repair in rollout/worker/extension.py knows the unquantized experts only). Engines at
    rollout.server_urls are not checked here: they run wherever they were started."""
    if not config.model.export_fp8:
        return
    rollout = config.rollout
    if rollout.server_urls or rollout.engine != "vllm":
        return
    if config.device == "cuda":
        return
    cpu_build = _vllm_cpu_build()
    on_cpu = config.device == "cpu" and rollout.mode == "colocated"
    if on_cpu or cpu_build:
        where = f"the installed vLLM, {cpu_build}, is its CPU build" if cpu_build else "device: cpu"
        raise ConfigError(
            f"model.export_fp8=true serves block-wise FP8 weights, which a CPU rollout engine cannot run here "
            f"({where}): vLLM's CPU build has block-FP8 kernels only for CPUs with Intel AMX, and weight "
            f"updates into them are unverified. Leave model.export_fp8 off on CPU (the engines get the "
            f"rollout dtype), or use GPU engines"
        )


def engines_on_cpu(config) -> bool:
    """Whether the vLLM engines this run starts run vLLM's CPU build: a colocated engine with
    device: cpu, or any engine we start from an installed CPU build (servers at
    rollout.server_urls run wherever they were started)."""
    rollout = config.rollout
    if rollout.server_urls or rollout.engine != "vllm" or config.device == "cuda":
        return False
    return (config.device == "cpu" and rollout.mode == "colocated") or _vllm_cpu_build() is not None


def _vllm_cpu_build() -> str | None:
    """'vllm-cpu X' / 'vllm X+cpu' when the vLLM installed here is the CPU build, else None
    (read from the package metadata: importing vLLM takes seconds)."""
    from importlib import metadata

    for name in ("vllm-cpu", "vllm"):
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if name == "vllm-cpu" or "cpu" in version:
            return f"{name} {version}"
    return None


def preflight(config):
    """Every check before the runtime starts: the fast ones first, then the slower ones (imports,
    files, reward functions). Returns the (train, held-out) prompt datasets it read, so that the
    trainer does not read them a second time."""
    from megatron_rl.algorithms.from_config import recipe_for
    from megatron_rl.checkpoint.manager import check_run_directory
    from megatron_rl.data import load_datasets
    from megatron_rl.observability.metrics_log import check_wandb_available
    from megatron_rl.rewards import build_scorer
    from megatron_rl.rollout.factory import check_engine_installed
    from megatron_rl.train.warm_start import check_targets

    check_layout_and_paths(config)
    try:
        recipe_for(config.rl)
    except ValueError as exc:
        raise ConfigError(f"rl: {exc}") from None
    check_run_directory(config)
    check_engine_installed(config)
    check_wandb_available(config.logging.wandb_mode)
    build_scorer(config.rewards).close()  # resolves every reward function now
    datasets = load_datasets(config.data)
    if config.warm_start.steps:
        check_targets(datasets[0])
    return datasets
