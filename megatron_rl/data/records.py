"""A prompt record and a dataset of them, and how one row of any source becomes a record.

A record is a prompt (text, or a list of chat messages ``{"role", "content"}``), an optional
reference answer, and metadata: every other top-level field of the row, handed to reward
functions as keyword arguments (see prompts.py for the rules). Both readers (the built-in one in
prompts.py and the ``datasets`` one in hf_datasets.py) turn rows into records here, so a prompt is
checked in one place: a string or chat messages, and some text that is not whitespace (an empty
prompt would be sampled like any other and teach nothing). Each record keeps its location ("FILE
line N", "FILE row index N") for the checks that run after loading (preflight's prompt lengths).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

from megatron_rl.data.config import RESERVED_NAMES
from megatron_rl.errors import ConfigError

__all__ = ["Message", "PromptRecord", "PromptDataset", "prompt_text", "get_field", "record_from_row"]


Message = Mapping[str, str]


@dataclass(frozen=True)
class PromptRecord:
    prompt: str | tuple[Message, ...]
    answer: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    # Where the record came from, for messages about it; not part of its value.
    location: str = field(default="", compare=False, repr=False)


class PromptDataset(Sequence[PromptRecord]):
    """An immutable, indexable list of records and where they came from (for messages)."""

    def __init__(self, records: Sequence[PromptRecord], source: str):
        if not records:
            raise ConfigError(f"{source}: no prompt records")
        self._records = tuple(records)
        self.source = source

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index):  # type: ignore[override]
        return self._records[index]

    def __iter__(self) -> Iterator[PromptRecord]:
        return iter(self._records)

    def select(self, indices: Sequence[int]) -> list[PromptRecord]:
        return [self._records[i] for i in indices]

    def __repr__(self) -> str:
        return f"PromptDataset({len(self)} records from {self.source})"


def prompt_text(prompt: str | Sequence[Message]) -> str:
    """The text a reward function sees as ``prompt``: the text, or the last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [message["content"] for message in prompt if message.get("role") == "user"]
    return users[-1] if users else prompt[-1]["content"]


# --------------------------------------------------------------------------- fields


def get_field(row: Mapping[str, Any], key: str) -> Any:
    """``row[key]`` where a dotted key walks nested mappings and lists ("messages.0.content").

    A key present as a whole (a field literally named "a.b") wins over the dotted walk.
    Raises KeyError with the part that is missing.
    """
    if key in row:
        return row[key]
    node: Any = row
    walked: list[str] = []
    for part in key.split("."):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            where = f"under '{'.'.join(walked)}'" if walked else "at the top level"
            keys = f"; it has {', '.join(map(repr, list(node)[:10]))}" if isinstance(node, Mapping) else ""
            raise KeyError(f"missing key '{part}' {where}{keys}")
        walked.append(part)
    return node


def _blank_prompt(where: str, what: str) -> ConfigError:
    return ConfigError(f"{where}: the prompt is empty or only whitespace ({what}); give the row a prompt "
                       "or remove the row")


def _as_prompt(value: Any, where: str) -> str | tuple[Message, ...]:
    if isinstance(value, str):
        if not value.strip():
            raise _blank_prompt(where, f"{len(value)} whitespace characters" if value else "an empty string")
        return value
    if isinstance(value, (list, tuple)) and value:
        messages = []
        for i, message in enumerate(value):
            if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise ConfigError(f"{where}: chat message {i} must be a mapping with string 'role' and 'content'")
            messages.append({"role": message["role"], "content": message["content"]})
        # A blank message among others is kept (some sets carry an empty system message); all blank
        # is no prompt at all.
        if not any(message["content"].strip() for message in messages):
            raise _blank_prompt(where, f"all {len(messages)} chat messages have blank content")
        return tuple(messages)
    raise ConfigError(f"{where}: the prompt must be a string or a list of chat messages, got {type(value).__name__}")


def _as_answer(value: Any, where: str) -> str:
    # Numbers are common in math sets (GSM8K-style integer answers); their text is the answer.
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{where}: the answer must be a string or a number, got {type(value).__name__} {value!r}")


def _metadata(row: Mapping[str, Any], where: str, prompt_key: str, answer_key: str | None,
              columns: Mapping[str, str], keep_other: bool) -> dict[str, Any]:
    metadata = {}
    if keep_other:
        metadata = {k: v for k, v in row.items()
                    if k not in RESERVED_NAMES and k not in (prompt_key, answer_key) and k not in columns}
    for source, target in columns.items():
        try:
            value = get_field(row, source)
        except KeyError as exc:
            raise ConfigError(f"{where}: data.columns key '{source}': {exc.args[0]}") from None
        if target in metadata:
            raise ConfigError(
                f"{where}: data.columns renames '{source}' to '{target}', but the row also has a field "
                f"'{target}'; rename that one too in data.columns, or set data.other_columns=drop"
            )
        metadata[target] = value
    return metadata


def record_from_row(row: Any, where: str, prompt_key: str, answer_key: str | None,
            columns: Mapping[str, str] | None = None, keep_other: bool = True) -> PromptRecord:
    if not isinstance(row, Mapping):
        raise ConfigError(f"{where}: expected an object with fields, got {type(row).__name__}")
    values = {}
    for role, key in (("prompt", prompt_key), ("answer", answer_key)):
        if key is None:
            continue
        try:
            values[role] = get_field(row, key)
        except KeyError as exc:
            raise ConfigError(f"{where}: {role} key '{key}': {exc.args[0]}") from None
    metadata = _metadata(row, where, prompt_key, answer_key, columns or {}, keep_other)
    answer = _as_answer(values["answer"], f"{where}: answer key '{answer_key}'") if answer_key else None
    return PromptRecord(_as_prompt(values["prompt"], f"{where}: prompt key '{prompt_key}'"), answer, metadata, where)
