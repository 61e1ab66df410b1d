"""One typed configuration tree for a run.

Every setting a run uses lives in nested dataclasses, loaded from a YAML recipe plus
command-line overrides (`section.key=value`). Loading validates everything that can be checked
without starting processes: unknown keys (with a suggestion), wrong types, out-of-range values and
parallel layouts Megatron-Core trains wrongly. Errors (`megatron_rl.errors.ConfigError`) name the
file and the dotted key, so a bad recipe fails in milliseconds instead of after model construction.

    loader.py    YAML, overrides, coercion: load_config(path, overrides) -> RunConfig; parse_config; to_dict
    run.py       RunConfig (the root) and the checks that cross sections; warm_start, checkpoint, logging
    model.py     model, parallel layout, optimizer
    rollout.py   rollout engines
    rl.py        the RL loop and the algorithm knobs (names from algorithms/names.py)
    data and rewards sections: data/config.py, rewards/config.py (beside the code they configure)
"""

from megatron_rl.config.loader import load_config, parse_config, to_dict
from megatron_rl.config.model import LoraConfig, ModelConfig, OptimizerConfig, ParallelConfig
from megatron_rl.config.rl import RLConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.run import CheckpointConfig, LoggingConfig, RunConfig, WarmStartConfig

__all__ = [
    "CheckpointConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "RLConfig",
    "RolloutConfig",
    "RunConfig",
    "WarmStartConfig",
    "load_config",
    "parse_config",
    "to_dict",
]
