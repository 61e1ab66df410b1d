"""Which model.lora the adapters of a checkpoint were trained with, and the run that must match it.

A checkpoint holds LoRA adapters when a LoRA run saved it (its trainer_state.json records the
run's config) or `megatron-rl convert peft-to-megatron` wrote it (megatron_rl.json `lora`: the
model.lora the PEFT adapter implies). `checkpoint.init_from` loads such adapters only into a run
with the same rank, alpha and targets: `check_run_lora` refuses any other, by name, before a
weight is read.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_rl.errors import ConfigError


def recorded_lora(ckpt: Path, metadata: dict) -> dict | None:
    """The model.lora of the adapters checkpoint `ckpt` holds (`metadata`: its megatron_rl.json,
    as read_metadata checked it), or None when it holds none. ConfigError naming the file and
    the key for a recorded value of the wrong type or out of bounds (`checked_lora`)."""
    from megatron_rl.checkpoint.store import STATE

    lora = metadata.get("lora")
    if lora is None and (ckpt / STATE).is_file():
        try:
            lora = json.loads((ckpt / STATE).read_text()).get("config", {}).get("model", {}).get("lora")
        except (OSError, ValueError, AttributeError):
            return None  # not the trainer state a run writes: its own readers name it
        if lora is not None:
            checked_lora(lora, ckpt / STATE, "config.model.lora")
    return lora if isinstance(lora, dict) else None


def checked_lora(lora, path: Path, key: str) -> dict:
    """`lora`, a model.lora as file `path` records it under `key`, once its values are checked as
    the config's own are: ConfigError naming the file and the key otherwise (the values become
    config overrides and messages later, which would blame the command line or fail to format)."""
    from megatron_rl.config import LoraConfig
    from megatron_rl.config.loader import parse_section

    parse_section(LoraConfig, lora, str(path), key)
    return lora


def check_run_lora(ckpt: Path, metadata: dict, lora, arch, key: str = "checkpoint.init_from") -> None:
    """Refuse a run whose model.lora (`lora`; None without) disagrees with the adapters checkpoint
    `ckpt` holds in rank, alpha or targets: they would not load as trained, or (no model.lora) the
    run would start from the base without them. A checkpoint without adapters loads into any run
    (a LoRA run's adapters then start at B = 0)."""
    from megatron_rl.config import LoraConfig
    from megatron_rl.config.model import LORA_TARGETS
    from megatron_rl.model.layout_checks import lora_targets

    recorded = recorded_lora(ckpt, metadata)
    if recorded is None:
        return
    theirs = LoraConfig(**{k: recorded[k] for k in ("rank", "alpha", "targets") if k in recorded})
    wanted = (f"model.lora.rank={theirs.rank} model.lora.alpha={theirs.alpha:g} "
              f"model.lora.targets=[{','.join(lora_targets(theirs, arch))}]")
    if lora is None:
        raise ConfigError(f"{key}: {ckpt} holds LoRA adapters and the run has no model.lora, so it would start from "
                          f"the base without them; set {wanted}, or start from the merged model (`megatron-rl "
                          "convert megatron-to-hf --merge-lora`)")
    def settings(of) -> dict:  # targets in config/model.py's order, whatever order they were named in
        return {"rank": of.rank, "alpha": float(of.alpha),
                "targets": [t for t in LORA_TARGETS if t in lora_targets(of, arch)]}

    ours, saved = settings(lora), settings(theirs)
    differ = [f"model.lora.{field} is {ours[field]}, the checkpoint's {saved[field]}" for field in ours
              if ours[field] != saved[field]]
    if differ:
        raise ConfigError(f"{key}: the run's model.lora disagrees with the adapters {ckpt} holds ({'; '.join(differ)}); "
                          f"set {wanted}")
