"""Loading: YAML + dotted overrides -> the typed tree, with errors that name the file and the key.

Unknown keys get a suggestion, wrong types and out-of-range values are refused, and a key given
twice in one YAML mapping is refused with both line numbers; then the whole tree validates.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron_rl.config.run import RunConfig
from megatron_rl.errors import ConfigError


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Build a validated RunConfig from an optional YAML file and `a.b=value` overrides. An error
    names where the bad value came from: the file ("defaults" without one), or the command line
    with the override(s) that caused it."""
    raw: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        source = str(path)
        loaded = _read_yaml(path)
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping, got {type(loaded).__name__}")
        raw = loaded
    overrides = list(overrides or [])
    try:
        return _validated(raw, overrides, source)
    except ConfigError as exc:
        raise _blamed(exc, raw, overrides, source) from None


def _validated(raw: dict[str, Any], overrides: list[str], source: str) -> RunConfig:
    raw = copy.deepcopy(raw)
    for item in overrides:
        _apply_override(raw, item)
    return _build(RunConfig, raw, source=source, prefix="").validate(source)


def _blamed(error: ConfigError, raw: dict[str, Any], overrides: list[str], source: str) -> ConfigError:
    """`error` (raised under `source`'s name) naming the overrides it comes from: those without
    which the config does not fail this way (only on the error path: the config is built again once
    per override, milliseconds)."""
    culprits = []
    for index, item in enumerate(overrides):
        try:
            _validated(raw, overrides[:index] + overrides[index + 1:], source)
        except ConfigError as without:
            if str(without) == str(error):
                continue  # fails the same without it: not this one
        culprits.append(item)
    text = str(error)
    if not culprits or not text.startswith(f"{source}: "):
        return error
    return ConfigError(f"command line ({', '.join(culprits)}): {text[len(source) + 2:]}")


def parse_config(raw: dict[str, Any], source: str) -> RunConfig:
    """The RunConfig a raw mapping reads as today (spellings coerced, unknown keys refused), not
    validated: how a checkpoint's recorded config is compared with the current one."""
    return _build(RunConfig, raw, source=source, prefix="")


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first_line: int, second_line: int):
        super().__init__(key, first_line, second_line)
        self.key, self.first_line, self.second_line = key, first_line, second_line


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML silently keeps the last,
    so a recipe edited in two places would run with whichever value happens to come later)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *anchor` then overriding a merged key is not a duplicate
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise _DuplicateKey(key, seen[key], line)
                    seen[key] = line
                except TypeError:
                    pass  # an unhashable key: SafeLoader reports it below
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> Any:
    """The parsed content of a YAML config file, with errors that name the file."""
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; --config expects a YAML file "
                          "(e.g. configs/tiny_cpu.yaml)")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        return yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except _DuplicateKey as dup:
        raise ConfigError(f"{path}: key {dup.key!r} is given twice (line {dup.first_line} and line "
                          f"{dup.second_line}); keep one of them") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc


def _apply_override(raw: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    dotted, text = item.split("=", 1)
    keys = dotted.strip().split(".")
    node = raw
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {key} is not a section")
    node[keys[-1]] = yaml.safe_load(text) if text.strip() else None


def _build(cls: type, raw: Any, source: str, prefix: str) -> Any:
    where = f"{source}: {prefix.rstrip('.') or 'top level'}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping for {cls.__name__}, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in raw if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), list(fields), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(fields)}"
        raise ConfigError(f"{source}: unknown key '{prefix}{key}'{hint}")
    values = {}
    for name, value in raw.items():
        # A field may name a function that maps accepted spellings first (rl.routing_replay: true).
        value = fields[name].metadata.get("coerce", lambda given: given)(value)
        values[name] = _coerce(hints[name], value, source, f"{prefix}{name}")
    return cls(**values)


def _coerce(hint: Any, value: Any, source: str, key: str) -> Any:
    where = f"{source}: {key}"
    origin = typing.get_origin(hint)
    if isinstance(hint, type) and hasattr(hint, "from_dict"):
        # Sections with list-of-mapping fields (rewards.terms) parse themselves.
        return hint.from_dict(value if value is not None else {}, key)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value if value is not None else {}, source, f"{key}.")
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(option, value, source, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} fits none of {hint}")
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, allowed))}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):
            # YAML 1.1 reads exponents without a dot (3e-6) as strings; accept them as numbers.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(item, element, source, f"{key}[{index}]") for index, element in enumerate(value)]
    if hint is dict:
        # Free-form keyword arguments handed to user code (rollout.environment_args, agent_args), as written.
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return value
    if origin is dict:
        # Name mappings (data.columns); keys are checked like values, errors name "key.<name>".
        key_hint, value_hint = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return {_coerce(key_hint, k, source, key): _coerce(value_hint, v, source, f"{key}.{k}")
                for k, v in value.items()}
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported config type {hint}")  # a bug in this module, not input


def to_dict(config: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)
