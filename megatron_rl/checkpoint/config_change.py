"""Whether a checkpoint may be resumed with this run's config: which keys may differ (the layout,
logging, checkpointing, performance knobs), which changes checkpoint.allow_config_change applies
from the resumed step, and which a resume cannot apply (refused by name, with why)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_rl.config import RunConfig, parse_config, to_dict
from megatron_rl.config.model import LEVERS_OFF
from megatron_rl.errors import ConfigError

# Keys that may differ between the run that wrote a checkpoint and the run resuming from it:
# the layout (checkpoints reshard), where and how it logs and checkpoints, performance knobs.
# The MoE throughput levers (config/model.py LEVERS_OFF) are such knobs: each computes the same
# step (fused kernels, another GEMM backend), so a resume may switch one on once it is measured.
MAY_DIFFER = ("parallel.", "logging.", "checkpoint.", "output_dir", "device", "micro_batch_tokens",
              "logprob_chunk_tokens", *(f"model.{lever}" for lever in LEVERS_OFF))
# Keys a resume cannot apply, with why: checkpoint.allow_config_change refuses a change to them
# rather than ignore it. Every other key takes effect from the resumed step on (the optimizer's
# settings too: model/policy.py takes its schedule's settings from the config, its position from
# the checkpoint).
FIXED_AT_START = {
    "warm_start.": "the warm start ran before the first RL step of the run that wrote this checkpoint; a resume "
                   "does not repeat it",
    "seed": "the prompt order and every random state continue from the checkpoint; a new seed would change only "
            "the engines' sampling seeds",
}

def config_differences(recorded: dict, current: dict) -> list[str]:
    """'key: recorded -> current' for every key that differs and may not (keys missing from the
    recorded config count as their defaults)."""
    return [f"{key}: {before!r} -> {after!r}" for key, before, after in _changed_keys(recorded, current)]


def _changed_keys(recorded: dict, current: dict) -> list[tuple[str, Any, Any]]:
    old = _as_parsed(recorded)
    new = flatten_config(current)
    return [(key, old.get(key), new.get(key)) for key in sorted(set(old) | set(new))
            if old.get(key) != new.get(key) and not key.startswith(MAY_DIFFER)]


def _fixed_at_start(changed: list[tuple[str, Any, Any]]) -> list[str]:
    """The changes among `changed` that a resume cannot apply, each with why."""
    return [f"{key}: {before!r} -> {after!r} ({why})" for key, before, after in changed
            for prefix, why in FIXED_AT_START.items() if key.startswith(prefix)]


def _as_parsed(recorded: dict) -> dict[str, Any]:
    """The recorded config as this version reads it, so a renamed spelling of the same setting
    (rl.routing_replay: true, now "training") is no difference; a config this version cannot
    parse any more is compared as written."""
    try:
        return flatten_config(to_dict(parse_config(recorded, "recorded config")))
    except ConfigError:
        return dict(flatten_config(to_dict(RunConfig())), **flatten_config(recorded))


def check_same_run(config: RunConfig, checkpoint: Path) -> None:
    from megatron_rl.checkpoint.store import STATE

    recorded = json.loads((checkpoint / STATE).read_text()).get("config")
    if recorded is None:
        return
    if config.checkpoint.allow_config_change:
        fixed = _fixed_at_start(_changed_keys(recorded, to_dict(config)))
        if fixed:
            listing = "\n  ".join(fixed)
            raise ConfigError(f"checkpoint.allow_config_change: resuming {checkpoint} cannot apply these changes:\n  "
                              f"{listing}\nResume with the recorded values, or start over with the new ones "
                              "(checkpoint.resume=none moves the old run aside, or another output_dir).")
        return
    differences = config_differences(recorded, to_dict(config))
    if differences:
        listing = "\n  ".join(differences)
        raise ConfigError(f"{checkpoint} was written by a run with another config; resuming it with this one "
                          f"would mix two experiments:\n  {listing}\nUse the original config, another output_dir, "
                          "checkpoint.resume=none to start over here (the old run is moved aside), or "
                          "checkpoint.allow_config_change=true if the change is intended.")


def flatten_config(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"rl.steps": 150, ...} from a nested config dict."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
