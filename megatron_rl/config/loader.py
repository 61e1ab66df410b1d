"""Loading: YAML + dotted overrides -> the typed tree, with errors that name the file and the key.

Unknown keys get a suggestion, wrong types and out-of-range values are refused, and a key given
twice in one YAML mapping is refused with both line numbers; then the whole tree validates.

Every YAML the run reads (the recipe, an override's value, the config.yaml a SLURM job requeues
from) goes through one loader, `_ConfigLoader`: PyYAML's SafeLoader (no Python objects) that
also refuses, before anything is built from the document,
- aliases that expand it by more than MAX_ALIAS_NODES nodes (a "billion laughs": PyYAML builds
  the aliases as shared references in milliseconds, and the first code that walks the tree, the
  checkpoint's copy of the config, expands all of them), and an alias inside its own anchor;
- nesting deeper than MAX_DEPTH (counted through aliases), which Python's recursion cannot walk.
Anchors stay allowed (`<<: *defaults` is how recipes share a section): an honest recipe's
aliases add tens or hundreds of nodes, far under the bound. Dates are not read as dates (no key
is one; `2024-01-01` stays text).

An override's value is YAML (`rl.steps=3`, `rollout.tools=[a, b]`), except for a key the tree
types as text (str, or str | None: paths, names, prompts): there it is the text after the `=` as
written, so `output_dir=/runs/a #b`, `output_dir=2024-01-01` and `output_dir=yes` are those
directories (for a key that may be null, `null`, `~` and nothing still mean null).
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
from megatron_rl.errors import ConfigError, not_a_file


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
    return load_config_dict(raw, overrides, source)


def load_config_dict(raw: dict[str, Any], overrides: list[str] | None = None, source: str = "defaults") -> RunConfig:
    """load_config for a mapping already read (`source`: where it came from, for messages): e.g. a
    run's recorded config under `megatron-rl eval`'s overrides."""
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


def parse_section(cls: type, raw: Any, source: str, key: str) -> Any:
    """One config section (`cls`, e.g. LoraConfig) as a file records it (`source`: the file, `key`:
    where in it), checked by type and bound as the config's own: each error names the file and
    the key (`FILE: key.field ...`), not the command line its values may be handed to later."""
    section = _build(cls, raw, source=source, prefix=f"{key}.")
    section.validate(f"{source}: {key}")
    return section


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first_line: int, second_line: int):
        super().__init__(key, first_line, second_line)
        self.key, self.first_line, self.second_line = key, first_line, second_line


# Nodes that aliases may add to a document (each alias counts the whole node it names, aliases
# inside that node included). A recipe's `<<: *defaults` adds tens; 100,000 nodes are copied by
# the config's consumers (dataclasses.asdict, json.dumps into the checkpoint) in well under a second.
MAX_ALIAS_NODES = 100_000
# Levels of nesting (mappings and lists, through aliases). A recipe has 3 or 4; Python's recursion
# (1,000 frames) gives out near 300 in the code that copies and writes the config.
MAX_DEPTH = 100
_NULLS = ("", "null", "Null", "NULL", "~")


class _Refused(Exception):
    """A document the loader will not build (aliases, depth); the message names the key and line."""


def _key_label(node: yaml.Node) -> str:
    return str(node.value) if isinstance(node, yaml.ScalarNode) else "?"


def _child_nodes(node: yaml.Node) -> list[tuple[str, yaml.Node, int | None]]:
    """(label for the key path, child, line of its key) of a collection node, in document order
    (a list item has no key: None)."""
    if isinstance(node, yaml.SequenceNode):
        return [(f"[{index}]", child, None) for index, child in enumerate(node.value)]
    if isinstance(node, yaml.MappingNode):
        children = []
        for key, value in node.value:
            label, line = f".{_key_label(key)}", key.start_mark.line + 1
            children += [(label, key, line), (label, value, line)]
        return children
    return []


def _check_aliases(root: yaml.Node) -> None:
    """Refuse a node graph whose aliases expand it by more than MAX_ALIAS_NODES nodes, nest it
    deeper than MAX_DEPTH, or refer to a node from inside it; without expanding anything (each
    node's expanded size and height are computed once, iteratively)."""
    size: dict[int, int] = {}
    height: dict[int, int] = {}
    added = 0
    # frames: [node, its children, next child index, size so far, height so far, key path, line]
    stack = [[root, _child_nodes(root), 0, 1, 1, "", root.start_mark.line + 1]]
    on_path = {id(root)}

    def where(label: str, line: int) -> str:
        path = "".join(frame[5] for frame in stack[1:]) + label
        return f"{path.lstrip('.') or 'top level'} (line {line})"

    while stack:
        frame = stack[-1]
        node, children, index = frame[0], frame[1], frame[2]
        if index == len(children):
            size[id(node)], height[id(node)] = frame[3], frame[4]
            on_path.discard(id(node))
            stack.pop()
            if stack:
                stack[-1][3] += frame[3]
                stack[-1][4] = max(stack[-1][4], frame[4] + 1)
            continue
        frame[2] += 1
        label, child, line = children[index]
        if line is None:  # a list item: where it starts, or for an alias (the node is the anchor's) its list's line
            line = frame[6] if id(child) in size or id(child) in on_path else child.start_mark.line + 1
        if id(child) in on_path:
            raise _Refused(f"{where(label, line)}: an alias refers to a node that contains it (a recursive "
                           "structure, which no setting takes); write the value out")
        if id(child) in size:  # a second reference to a node: an alias, expanded by whoever walks the tree
            added += size[id(child)]
            if added > MAX_ALIAS_NODES:
                raise _Refused(f"{where(label, line)}: YAML aliases expand the document by more than "
                               f"{MAX_ALIAS_NODES:,} nodes (this one alone adds {size[id(child)]:,}): refused "
                               "before anything reads it (a \"billion laughs\"); write the values out, or use "
                               "fewer aliases")
            if len(stack) + height[id(child)] > MAX_DEPTH:
                raise _Refused(f"{where(label, line)}: nested more than {MAX_DEPTH} levels deep through aliases")
            frame[3] += size[id(child)]
            frame[4] = max(frame[4], height[id(child)] + 1)
            continue
        if len(stack) >= MAX_DEPTH:
            raise _Refused(f"{where(label, line)}: nested more than {MAX_DEPTH} levels deep")
        stack.append([child, _child_nodes(child), 0, 1, 1, label, line])
        on_path.add(id(child))


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML silently keeps the last,
    so a recipe edited in two places would run with whichever value happens to come later),
    refuses alias bombs and deep nesting before constructing anything (`_check_aliases`), and
    reads no dates."""

    # SafeLoader's implicit types less timestamps: `2024-01-01` is text (no setting is a date, and
    # a date in a free-form mapping could not be written into the checkpoint's JSON).
    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        # PyYAML composes recursively: bound the depth before Python's recursion limit does.
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise _Refused(f"line {mark.line + 1}: nested more than {MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_data(self):
        node = self.get_single_node()
        if node is None:
            return None
        _check_aliases(node)
        return self.construct_document(node)

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


def load_yaml(text: str, where: str) -> Any:
    """`text` parsed by the config loader; every refusal is a ConfigError starting with `where`."""
    try:
        return yaml.load(text, Loader=_ConfigLoader)
    except _DuplicateKey as dup:
        raise ConfigError(f"{where}: key {dup.key!r} is given twice (line {dup.first_line} and line "
                          f"{dup.second_line}); keep one of them") from None
    except _Refused as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except RecursionError:  # a guard above missed a recursive path: still a refusal, not a traceback
        raise ConfigError(f"{where}: nested too deeply to read") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {exc}") from exc


def _read_yaml(path: Path) -> Any:
    """The parsed content of a YAML config file, with errors that name the file."""
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; --config expects a YAML file "
                          "(e.g. configs/tiny_cpu.yaml)")
    problem = not_a_file(path)  # never opened when it is not a file (a FIFO would block)
    if problem:
        raise ConfigError(f"config file {path} {problem}")
    return load_yaml(path.read_text(), str(path))


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
    node[keys[-1]] = _override_value(keys, text, item)


def _override_value(keys: list[str], text: str, item: str) -> Any:
    """An override's value: the text as written for a key typed as text (a path is a path: no
    comment stripped, no date, no boolean, no folded newline), YAML for every other key."""
    hint = _hint_at(keys)
    if hint is str:
        return text
    if _is_optional_text(hint):
        return None if text.strip() in _NULLS else text
    if not text.strip():
        return None
    return load_yaml(text, f"override {item!r}")


def _hint_at(keys: list[str]) -> Any:
    """The type the config tree gives the dotted key (None where it does not say: unknown keys,
    free-form mappings, sections that parse themselves)."""
    hint: Any = RunConfig
    for key in keys:
        section = _section_of(hint)
        if section is not None:
            hints = typing.get_type_hints(section)
            if key not in hints:
                return None
            hint = hints[key]
        elif typing.get_origin(hint) is dict:
            hint = typing.get_args(hint)[1]  # a name mapping's value (data.columns.<field>)
        else:
            return None
    return hint


def _section_of(hint: Any) -> type | None:
    """The dataclass a hint (or an optional one) names, unless it parses itself (from_dict)."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for option in options:
        if dataclasses.is_dataclass(option) and isinstance(option, type) and not hasattr(option, "from_dict"):
            return option
    return None


def _is_optional_text(hint: Any) -> bool:
    return (typing.get_origin(hint) in (typing.Union, types.UnionType)
            and set(typing.get_args(hint)) == {str, type(None)})


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
