"""Prompt datasets: local files, ``datasets`` save_to_disk directories, or a synthetic task's splits.

A record is a prompt (text, or a list of chat messages ``{"role", "content"}``), an optional
reference answer, and metadata: every other top-level field of the row, handed to reward
functions as keyword arguments. Fields named ``prompt``, ``response`` or ``answer`` are never
metadata (they would collide with the reward function's own arguments). ``data.columns`` renames
metadata fields ({field: keyword}, dotted fields allowed) and ``data.other_columns="drop"`` keeps
only those; a renamed field whose new name is also another field of the row is refused (one of
the two would be lost silently).

Which reader (``load_datasets``, ``data.loader``): JSON Lines and Parquet files go to the built-in
reader here unless ``data.loader="datasets"``; .json / .csv / .arrow files and save_to_disk
directories go through the ``datasets`` library (``hf_datasets.py``, imported only then). A
path that does not exist is refused naming the key: nothing is downloaded at run time.

Every problem with a file is a ConfigError naming the file, the line (JSONL, 1-based) or row
(Parquet, 0-based index) and the key: a missing field, a value of the wrong type, invalid JSON,
a line that is not UTF-8 (with the byte offset in the file), a prompt that is empty or only
whitespace. Files are read whole at start-up, so a bad row fails the run before any model is
built; preflight then counts every prompt's tokens against the engine's limit
(``data.overlong_prompts``).

Untrusted lines are bounded before they are parsed: a JSONL line longer than
``data.max_line_bytes`` (16 MiB by default: a million-token prompt at 16 bytes a token) is
refused after reading that many bytes of it, never the rest (a file without line breaks, a
multi-GB line); a row nested deeper than MAX_JSON_DEPTH levels of arrays and objects (which
Python's JSON parser and the code that copies and pickles metadata cannot recurse through) is
refused by its line too. A Parquet row is bounded by the same key (data/parquet_rows.py: its
fields' text together, checked before a compressed file is decompressed whole), and so is a
row read through `datasets` (data/hf_datasets.py).
Parquet needs ``pyarrow`` (``pip install pyarrow``); JSONL needs nothing.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping

from megatron_rl.data.config import RESERVED_NAMES, DataConfig
# Imports `datasets` only when a dataset is read through it.
from megatron_rl.data.hf_datasets import SUFFIX_BUILDERS, load_hf_prompts
from megatron_rl.data.parquet_rows import parquet_rows
from megatron_rl.data.records import PromptDataset, PromptRecord, get_field, prompt_text, record_from_row
from megatron_rl.errors import ConfigError, nested_deeper, not_a_file
from megatron_rl.rewards.synthetic import TaskConfig, make_task

__all__ = [
    "PromptRecord",
    "PromptDataset",
    "load_prompts",
    "synthetic_datasets",
    "load_datasets",
    "load_source",
    "prompt_text",
    "get_field",
]

# --------------------------------------------------------------------------- files


def _decode_line(raw: bytes, path: Path, number: int, offset: int) -> str:
    """One line as text. Lines are decoded one by one (not by a text-mode file) so that a bad byte
    is reported with its line and its offset in the file, not as a bare UnicodeDecodeError."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = raw[exc.start:exc.start + 1]
        raise ConfigError(
            f"{path} line {number}: not valid UTF-8 (byte {bad!r} at byte offset {offset + exc.start} of the "
            f"file: {exc.reason}); prompt files must be UTF-8: re-encode the file as UTF-8 (e.g. "
            f"`iconv -f latin1 -t utf-8`, with the encoding it was written in) or fix that line"
        ) from None


# Levels of nested arrays and objects a row may have. A chat prompt has 4 (row, messages, message,
# content parts); Python's JSON parser gives out near 1,000, and pickling metadata to the reward
# workers or copying it recurses as deep, so this refuses a hostile row by name long before that.
MAX_JSON_DEPTH = 100


def _too_deep_error(path: Path, number: int) -> ConfigError:
    return ConfigError(f"{path} line {number}: nested more than {MAX_JSON_DEPTH} levels deep (arrays and objects); "
                       "a prompt row is an object of text, chat messages and metadata")


def _jsonl_rows(path: Path, max_line_bytes: int) -> Iterator[tuple[str, Any]]:
    offset = 0
    with path.open("rb") as handle:
        for number in itertools.count(1):
            raw = handle.readline(max_line_bytes + 1)  # never more than the limit (and its line break) in memory
            if not raw:
                return
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                raise ConfigError(
                    f"{path} line {number}: longer than data.max_line_bytes={max_line_bytes} bytes (refused after "
                    f"reading that much of it); a JSON Lines file holds one record per line. If a record (its "
                    f"metadata included) really is that large, raise data.max_line_bytes; otherwise fix the file"
                )
            line = _decode_line(raw, path, number, offset)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path} line {number}: not valid JSON: {exc.msg} (column {exc.colno})") from None
            except RecursionError:  # deeper than the parser recurses
                raise _too_deep_error(path, number) from None
            # Counting brackets first keeps the walk off every ordinary row.
            if line.count("[") + line.count("{") > MAX_JSON_DEPTH and nested_deeper(row, MAX_JSON_DEPTH):
                raise _too_deep_error(path, number)
            yield f"{path} line {number}", row


_READERS = {".jsonl": _jsonl_rows, ".parquet": parquet_rows}


def load_prompts(path: str | Path, *, prompt_key: str = "prompt", answer_key: str | None = "answer",
                 columns: Mapping[str, str] | None = None, other_columns: str = "keep",
                 max_line_bytes: int = DataConfig.max_line_bytes) -> PromptDataset:
    """Read every record of a .jsonl or .parquet file (see the module docstring for errors)."""
    path = Path(path)
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise ConfigError(f"{path}: unsupported prompt file type {path.suffix!r}; use {' or '.join(_READERS)}")
    problem = not_a_file(path)  # never opened when it is not a file (a FIFO would block)
    if problem:
        raise ConfigError(f"prompt file {path} {problem}")
    keep_other = other_columns == "keep"
    rows = reader(path, max_line_bytes)
    records = [record_from_row(row, where, prompt_key, answer_key, columns, keep_other) for where, row in rows]
    return PromptDataset(records, str(path))


# --------------------------------------------------------------------------- synthetic


def synthetic_datasets(
    task: TaskConfig, *, num_train: int, num_heldout: int, seed: int
) -> tuple[PromptDataset, PromptDataset | None]:
    """Train and held-out datasets of a synthetic task (disjoint; see ``rewards/synthetic.py``)."""
    generator = make_task(task)

    def dataset(n: int, split: str) -> PromptDataset:
        source = f"synthetic task {task.task!r} ({split} split, seed {seed})"
        records = [
            PromptRecord(row["prompt"], row["answer"], {k: v for k, v in row.items() if k not in RESERVED_NAMES},
                         f"{source} record {index}")
            for index, row in enumerate(generator.generate(n, seed=seed, split=split))
        ]
        return PromptDataset(records, source)

    return dataset(num_train, "train"), dataset(num_heldout, "heldout") if num_heldout else None


# --------------------------------------------------------------------------- config -> dataset

_BUILTIN_SUFFIXES = (".jsonl", ".parquet")


def _missing_path(key: str, path: Path) -> ConfigError:
    suffixes = ", ".join(sorted(set(_BUILTIN_SUFFIXES) | set(SUFFIX_BUILDERS)))
    hint = ""
    if not path.suffix and not path.is_absolute() and len(path.parts) == 2:
        # "org/name" is how hub datasets are named; say how to bring one onto this machine.
        hint = (f"; if '{path}' is a hub dataset, save it where the hub is reachable with "
                f"`datasets.load_dataset('{path}').save_to_disk(DIR)` and set {key}=DIR")
    return ConfigError(
        f"{key}: prompt file {path} does not exist; it must be a local file ({suffixes}) or a directory "
        f"written by `datasets` save_to_disk (nothing is downloaded at run time){hint}"
    )


def _uses_datasets(config: DataConfig, key: str, path: Path) -> bool:
    """Whether ``path`` is read through ``datasets`` (True) or the built-in reader (False)."""
    if config.loader == "datasets":
        return True
    if path.is_dir():
        if config.loader == "builtin":
            raise ConfigError(
                f"{key}: {path} is a directory; data.loader=builtin reads .jsonl / .parquet files only "
                "(use data.loader=auto for a `datasets` save_to_disk directory)"
            )
        return True
    # The built-in reader keeps its own "unsupported file type" error for other suffixes.
    return config.loader == "auto" and path.suffix.lower() not in _BUILTIN_SUFFIXES


def load_source(config: DataConfig, key: Literal["train", "heldout"]) -> PromptDataset:
    """The dataset ``data.<key>`` names (a file or a save_to_disk directory), read as configured."""
    path = Path(getattr(config, key))
    if not path.exists():
        raise _missing_path(f"data.{key}", path)
    if not path.is_dir() and (problem := not_a_file(path)):
        raise ConfigError(f"data.{key}: prompt file {path} {problem}; it must be a file or a directory written "
                          "by `datasets` save_to_disk")
    fields = dict(prompt_key=config.prompt_key, answer_key=config.answer_key, columns=config.columns,
                  other_columns=config.other_columns)
    if not _uses_datasets(config, f"data.{key}", path):
        return load_prompts(path, max_line_bytes=config.max_line_bytes, **fields)
    return load_hf_prompts(path, key=key, split=getattr(config, f"{key}_split"), max_line_bytes=config.max_line_bytes,
                           **fields)


def check_sources_exist(config: DataConfig) -> None:
    """data.train and data.heldout name paths that exist, nothing read: what `launch slurm` checks
    before a job waits in the queue only to find its prompt file missing (the job reads them whole)."""
    for key in ("train", "heldout"):
        value = getattr(config, key)
        if value is None or (key == "train" and value == "synthetic"):
            continue
        if not Path(value).exists():
            raise _missing_path(f"data.{key}", Path(value))


def load_datasets(config: DataConfig) -> tuple[PromptDataset, PromptDataset | None]:
    """The run's train dataset and optional held-out dataset, as the data config describes."""
    config.validate()
    if config.train == "synthetic":
        train, _ = synthetic_datasets(config.synthetic, num_train=config.num_train, num_heldout=0,
                                      seed=config.synthetic_seed)
    else:
        train = load_source(config, "train")
    return train, load_heldout(config)


def load_heldout(config: DataConfig) -> PromptDataset | None:
    """The run's held-out dataset alone: data.heldout's prompts, else the synthetic task's held-out
    split (data.num_heldout prompts; each split is a function of the task and seed alone), else
    None. What training evaluates (eval/accuracy) and what the set PATH `heldout` names."""
    config.validate()
    if config.heldout is not None:
        return load_source(config, "heldout")
    if config.train == "synthetic":
        # One train record (a dataset is never empty); each split is drawn on its own, so the
        # held-out split is the one load_datasets builds beside data.num_train records.
        return synthetic_datasets(config.synthetic, num_train=1, num_heldout=config.num_heldout,
                                  seed=config.synthetic_seed)[1]
    return None
