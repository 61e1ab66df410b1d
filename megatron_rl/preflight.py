"""The checks that make a bad run fail in well under a second: the parallel layout against the
model and the world size, and the paths the run reads or must not overwrite. No torch import
(that alone takes seconds), so `megatron-rl train` runs these before anything else."""

from __future__ import annotations

from pathlib import Path

from megatron_rl.errors import ConfigError


def check_layout_and_paths(config, *, rl: bool = True) -> None:
    """`config`: a loaded RunConfig. Raises ConfigError naming the key and the reason.
    `rl=False` (`megatron-rl sft`): no rollout engine, so not its check. The run directory and
    its checkpoints are checked by megatron_rl.checkpoint_manager.check_run_directory."""
    from megatron_rl.model.hf_config import load_hf_config, parse_hf_config
    from megatron_rl.model.layout_checks import check_divisibility
    from megatron_rl.platform.launch_env import read_launch_env

    raw, source = load_hf_config(config.model.hf_config)
    arch = parse_hf_config(raw, source)
    world = read_launch_env().world_size
    config.parallel.validate_for_model("parallel", num_experts=arch.num_experts if arch.is_moe else None)
    check_divisibility(arch, config)
    config.parallel.validate_world_size(world)
    if rl and config.rollout.mode == "colocated" and arch.num_key_value_heads % world:
        raise ConfigError(
            f"rollout.mode=colocated shards the engine over all {world} ranks, which must divide the "
            f"model's {arch.num_key_value_heads} KV heads; use rollout.mode=server"
        )
    if config.checkpoint.init_from and not Path(config.checkpoint.init_from).exists():
        raise ConfigError(f"checkpoint.init_from: {config.checkpoint.init_from} does not exist")
