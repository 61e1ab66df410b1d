"""What `megatron-rl eval --ckpt PATH` accepts, told apart by the files alone (no torch), and the
config each checkpoint is evaluated with.

Kinds (the forms `checkpoint.init_from` reads, checkpoint/format.py):

    run directory               RUN (its checkpoints/latest)
    training checkpoint         RUN/checkpoints/step_NNNNNN, or RUN/checkpoints (its latest)
    converted Megatron checkpoint   a directory holding megatron_rl.json (`convert hf-to-megatron`, `sft`)
    Hugging Face directory      config.json and *.safetensors (a `convert megatron-to-hf` output,
                                a run's hf_model/, a download)

A LoRA run's checkpoint loads into a policy built with the run's model.lora, and is pushed to the
engine merged (rollout.lora_push=merged), as the trainer pushes it.

The config: a checkpoint written by a run is evaluated with that run's model, data (prompt format,
system prompt, fields), rewards and rl (the response budget) sections, recorded in the checkpoint;
anything else with --config's (default: the built-in tiny default's). The command's key=value
overrides go over either, and the engine's sections (rollout, parallel, device) are always the
command's own. model.hf_config is the checkpoint's own description (its hf_config/ or config.json)
unless the overrides name one. What eval takes from a recorded rewards section is checked where a
set is scored with it (evaluation/recorded_rewards.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.errors import ConfigError

KINDS = ("run directory", "training checkpoint", "converted Megatron checkpoint", "Hugging Face directory")
ACCEPTED = ("a run directory (RUN: its latest checkpoint), a training checkpoint (RUN/checkpoints/step_NNNNNN or "
            "RUN/checkpoints), a converted Megatron checkpoint (a directory holding megatron_rl.json) or a Hugging "
            "Face model directory (config.json and *.safetensors)")
# The sections a run's checkpoint brings with it: what the weights are and how the run asked and scored.
RUN_SECTIONS = ("model", "data", "rewards", "rl")
TRAINER_STATE = "trainer_state.json"  # checkpoint/store.py's STATE (that module imports torch)
EXPORT = "megatron_rl_export.json"  # in a run's hf_model/: how the run prompted the model, its step


@dataclass
class CheckpointSource:
    label: str  # how the report names it ("A", "B", ... or --label)
    path: str  # as given
    kind: str  # one of KINDS
    resolved: Path  # the directory the weights are read from (a run's latest step, the HF directory)
    run_dir: str | None  # the run that wrote it (None: unknown)
    step: int | None
    run_config: dict | None  # the run's recorded config (None: not written by a run)
    export: dict | None = None  # a run's hf_model/megatron_rl_export.json (prompt format, step)

    def describe(self) -> str:
        step = f", step {self.step}" if self.step is not None else ""
        return f"{self.label}: {self.path} ({self.kind}{step})"


def identify(path: str, label: str) -> CheckpointSource:
    """The kind of checkpoint `path` is, from its files; ConfigError naming the path and the kinds
    accepted when it is none of them (or one that cannot be read: a run without checkpoints, a
    `latest` naming nothing)."""
    from megatron_rl.checkpoint.locate import (METADATA, is_megatron_checkpoint, names_megatron_checkpoint,
                                               resolve_checkpoint)

    where = Path(path)
    if not where.exists():
        raise ConfigError(f"--ckpt {path} does not exist; pass {ACCEPTED}")
    if not where.is_dir():
        raise ConfigError(f"--ckpt {path} is a file, not a checkpoint; pass {ACCEPTED}")
    if names_megatron_checkpoint(where):
        try:
            resolved = resolve_checkpoint(where)
        except ConfigError as exc:
            raise ConfigError(f"--ckpt {path}: {exc}") from None
        metadata = _json_or_none(resolved / METADATA)  # read whole, and checked, when it is loaded
        if metadata is None:
            raise ConfigError(f"--ckpt {path}: {resolved / METADATA} is unreadable or not a JSON object; re-convert "
                              "it, or pass another checkpoint")
        if "weights_dir" not in metadata:
            return CheckpointSource(label, path, "converted Megatron checkpoint", resolved, None, None, None)
        state = _trainer_state(resolved, path)
        run_dir = resolved.parent.parent
        kind = "run directory" if (where / "checkpoints").is_dir() and not is_megatron_checkpoint(where) \
            else "training checkpoint"
        return CheckpointSource(label, path, kind, resolved, str(run_dir), state.get("step"), state.get("config"))
    if (where / "config.json").is_file() and (any(where.glob("*.safetensors"))
                                              or (where / "model.safetensors.index.json").is_file()):
        export = _export_record(where / EXPORT, path)
        run_dir = export.get("run") if export else None
        return CheckpointSource(label, path, "Hugging Face directory", where, run_dir,
                                export.get("step") if export else None, None, export)
    found = ", ".join(sorted(p.name for p in where.iterdir())[:8]) or "nothing"
    raise ConfigError(f"--ckpt {path} is not a checkpoint: it holds no {METADATA}, no checkpoints/ or latest, and no "
                      f"config.json with *.safetensors (it holds {found}); pass {ACCEPTED}")


def _trainer_state(ckpt: Path, given: str) -> dict:
    """The checkpoint's trainer_state.json, with the keys eval takes from it checked by type: its
    step (into the report) and its run's config sections (over --config's). Untrusted: a wrong
    kind failed with a TypeError here, or (a NaN step) only when eval.json was written, after
    every checkpoint had been evaluated."""
    path = ckpt / TRAINER_STATE
    state = _json_or_none(path)
    if state is None:
        raise ConfigError(f"{path} is missing or unreadable: the checkpoint is incomplete; pass another "
                          "step directory of the run")
    step, config = state.get("step"), state.get("config")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"--ckpt {given}: {path}: 'step' must be an integer >= 0, not {_shown(step)}; the checkpoint "
                          "is damaged: pass another step directory of the run")
    if config is not None and not isinstance(config, dict):
        raise ConfigError(f"--ckpt {given}: {path}: 'config' must be an object (the run's config), not "
                          f"{_shown(config)}; pass another step directory of the run")
    for section in RUN_SECTIONS:
        if config is not None and config.get(section) is not None and not isinstance(config[section], dict):
            raise ConfigError(f"--ckpt {given}: {path}: 'config.{section}' must be an object (the run's {section} "
                              f"section), not {_shown(config[section])}; pass another step directory of the run")
    return state


def _export_record(path: Path, given: str) -> dict | None:
    """A run's Hugging Face export record (checkpoint/manager.py writes it), None when there is
    none; the keys eval takes from it checked by type: `run` and `step` go into the report,
    prompt_format and system_prompt into the config (which checks their values). JSON's own
    numbers only: a NaN or Infinity (which Python's json reads) could not be written back to
    eval.json, and failed the command after every checkpoint had been evaluated."""
    from megatron_rl.data.config import PROMPT_FORMATS

    if not path.exists():
        return None
    fix = "fix it or remove it (it records only how the run prompted the model)"
    try:
        export = json.loads(path.read_text(), parse_constant=_no_constant, parse_float=_finite)
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigError(f"--ckpt {given}: {path} is unreadable ({exc}); {fix}") from None
    if not isinstance(export, dict):
        raise ConfigError(f"--ckpt {given}: {path} must be a JSON object, not {type(export).__name__}; {fix}")
    step = export.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ConfigError(f"--ckpt {given}: {path}: 'step' must be an integer >= 0 or null, not {_shown(step)}; {fix}")
    for key in ("run", "system_prompt"):
        if export.get(key) is not None and not isinstance(export[key], str):
            raise ConfigError(f"--ckpt {given}: {path}: {key!r} must be a string or null, not {_shown(export[key])}; "
                              f"{fix}")
    if "prompt_format" in export and export["prompt_format"] not in PROMPT_FORMATS:
        raise ConfigError(f"--ckpt {given}: {path}: 'prompt_format' must be one of {', '.join(PROMPT_FORMATS)}, not "
                          f"{_shown(export['prompt_format'])}; {fix}")
    return export


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is beyond the largest float")
    return value


def _shown(value) -> str:
    return json.dumps(value)[:40] if isinstance(value, (dict, list, str)) else repr(value)


def _json_or_none(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def checkpoint_config(source: CheckpointSource, base: dict, overrides: list[str], output_dir: str):
    """The RunConfig `source` is evaluated with: `base` (to_dict of the command's --config and
    overrides) with the run's RUN_SECTIONS over it when a run wrote the checkpoint, the
    overrides again on top (they always win), checkpoint.init_from the checkpoint, the rollout
    engine's push merged, model.hf_config the checkpoint's own unless an override names one."""
    from megatron_rl.config.loader import load_config_dict

    raw = json.loads(json.dumps(base))  # a deep copy
    origin = "--config (or the built-in default)"
    if source.run_config is not None:
        for section in RUN_SECTIONS:
            if section in source.run_config:
                raw[section] = source.run_config[section]
        origin = f"the config recorded in {source.resolved}"
    if source.export is not None:  # a run's export says how its prompts were formatted
        for key in ("prompt_format", "system_prompt"):
            if key in source.export:
                raw.setdefault("data", {})[key] = source.export[key]
    raw.setdefault("checkpoint", {})["init_from"] = str(source.resolved)
    raw.setdefault("rollout", {})["lora_push"] = "merged"
    raw["output_dir"] = output_dir
    if not any(item.split("=", 1)[0].strip() == "model.hf_config" for item in overrides):
        own = source.resolved / "hf_config" if source.kind != "Hugging Face directory" else source.resolved
        raw.setdefault("model", {})["hf_config"] = str(own)
    try:
        config = load_config_dict(raw, overrides, origin)
    except ConfigError as exc:
        raise ConfigError(f"--ckpt {source.path}: {exc}") from None
    return config


def check_same_model(sources: list[CheckpointSource], configs: list) -> None:
    """Every checkpoint has the architecture of the first (one engine serves them all, each pushed
    into it in turn): ConfigError naming the two that differ otherwise."""
    from megatron_rl.model.hf_config import load_hf_config, parse_hf_config

    first = None
    for source, config in zip(sources, configs):
        arch = parse_hf_config(*load_hf_config(config.model.hf_config))
        if first is None:
            first = (source, arch)
        elif arch != first[1]:
            raise ConfigError(f"--ckpt {source.path} is another model than --ckpt {first[0].path} (their config.json "
                              "differ): one engine serves every checkpoint of an evaluation, so evaluate them in "
                              "separate `megatron-rl eval` runs")
