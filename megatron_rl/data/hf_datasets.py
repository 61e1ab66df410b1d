"""Prompt datasets read through the Hugging Face ``datasets`` library.

Two kinds of local source (``prompts.load_source`` decides which reader a path gets):

* a directory written by ``Dataset.save_to_disk`` (it holds ``state.json``) or
  ``DatasetDict.save_to_disk`` (``dataset_dict.json``). For a DatasetDict, ``data.train_split`` /
  ``data.heldout_split`` pick the split, which is loaded alone (the other splits are not read);
  a directory holding one Dataset has no splits and the split keys are not used. A missing
  split is a ConfigError naming the splits there are.
* a .json / .jsonl / .csv / .parquet / .arrow file, read with
  ``datasets.load_dataset(<builder>, data_files=path, split="train")`` (one file is one split).
  ``load_dataset`` writes an Arrow cache; it goes to a temporary directory removed once the rows
  are records, so a run leaves nothing under the user's cache and never reads a stale one.

Nothing is downloaded: only packaged builders on local files are used, and paths that do not
exist are refused before this module is reached.

``datasets`` is imported inside the functions (about a second of imports), so runs that do not
use it never pay for it. Rows become records by the built-in reader's rules (``records.record_from_row``);
before that, every configured field (prompt_key, answer_key, the keys of data.columns) is looked
up among the dataset's columns, so a misspelled key names the columns there are instead of
failing on row 0. Errors name the path, the split and the row index (0-based).

Each row is bounded by ``data.max_line_bytes`` as a JSONL line and a built-in Parquet row are
(data/parquet_rows.py): rows are turned into Python BATCH_ROWS at a time and measured, and a
Parquet file's footer is checked before ``load_dataset`` decompresses it into its cache. Before,
the whole dataset became Python rows with none measured: a 2 KB Parquet file read this way held a
50 MB prompt.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

from megatron_rl.data.parquet_rows import BATCH_ROWS, check_row, check_row_groups
from megatron_rl.data.records import PromptDataset, record_from_row
from megatron_rl.errors import ConfigError

__all__ = ["SUFFIX_BUILDERS", "is_saved_dataset", "load_hf_prompts"]

# File suffix -> the packaged `datasets` builder that reads it.
SUFFIX_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())


def _import_datasets(path: Path):
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"{path}: reading it needs the `datasets` package; install it with `pip install datasets`"
        ) from None
    return datasets


@contextlib.contextmanager
def _quiet_progress(datasets) -> Iterator[None]:
    # Reading a prompt set takes a moment; progress bars would only clutter the run's log.
    was_enabled = not datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.utils.enable_progress_bars()


def _root_cause(exc: BaseException) -> BaseException:
    # `datasets` wraps the reader's error ("An error occurred while generating the dataset").
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def _read_error(path: Path, what: str, exc: BaseException) -> ConfigError:
    cause = _root_cause(exc)
    return ConfigError(f"{path}: `datasets` could not read it as {what}: {type(cause).__name__}: {cause}")


def _empty(source: str, key: str, split_hint: bool) -> ConfigError:
    where = f"data.{key}_split at a split" if split_hint else f"data.{key} at a dataset"
    return ConfigError(f"{source}: the dataset has no rows; point {where} with prompts")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested deeper than Python recurses
        raise ConfigError(f"{path}: not a readable save_to_disk file: {type(exc).__name__}: {exc}") from None


def _saved_split(path: Path, key: str, split: str) -> tuple[Any, str, bool]:
    """(Dataset, source text, whether it is a split) of a save_to_disk directory.

    A DatasetDict's split is loaded alone, from its own directory: the other splits are not
    read, so one broken or empty split does not stop a run that uses another.
    """
    if not is_saved_dataset(path):
        raise ConfigError(
            f"data.{key}: {path} is a directory but not one written by `datasets` save_to_disk (it has "
            "neither dataset_dict.json nor state.json); point it at such a directory or at a prompt file"
        )
    directory, source, is_split = path, str(path), False
    if (path / "dataset_dict.json").is_file():
        splits = _read_json(path / "dataset_dict.json").get("splits", [])
        if split not in splits:
            names = ", ".join(repr(name) for name in splits) or "none"
            raise ConfigError(
                f"data.{key}_split: {path} has no split {split!r}; its splits are {names}. "
                f"Set data.{key}_split to one of them"
            )
        directory, source, is_split = path / split, f"{path} split {split!r}", True
    # save_to_disk writes no data file for a dataset built empty, and load_from_disk then fails.
    if (directory / "state.json").is_file() and _read_json(directory / "state.json").get("_data_files") == []:
        raise _empty(source, key, is_split)
    datasets = _import_datasets(path)
    try:
        with _quiet_progress(datasets):
            dataset = datasets.load_from_disk(str(directory))
    except Exception as exc:  # corrupt or foreign files: datasets/pyarrow raise their own types
        raise _read_error(directory, "a save_to_disk directory", exc) from exc
    return dataset, source, is_split


def _file_rows(path: Path, key: str, fields: list[tuple[str, str]], keep_columns: list[str] | None,
               max_row_bytes: int) -> list[dict]:
    """Rows of a file read by ``load_dataset``, converted before its temporary cache goes away."""
    builder = SUFFIX_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ConfigError(
            f"data.{key}: unsupported prompt file type {path.suffix!r} for {path}; `datasets` reads "
            f"{', '.join(sorted(SUFFIX_BUILDERS))} files and save_to_disk directories"
        )
    if path.stat().st_size == 0:
        raise _empty(str(path), key, split_hint=False)
    datasets = _import_datasets(path)
    if builder == "parquet":  # the footer's sizes first: load_dataset decompresses the whole file into its cache
        try:  # datasets requires pyarrow; guarded as parquet_rows' import is (the GPU kit carries neither)
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(f"{path}: reading Parquet needs pyarrow; install it with `pip install pyarrow`") from None
        try:
            metadata = pq.ParquetFile(path).metadata
        except Exception as exc:  # pyarrow raises its own error types for corrupt or foreign files
            raise _read_error(path, "parquet (the 'parquet' builder)", exc) from exc
        check_row_groups(path, metadata, max_row_bytes)
    with tempfile.TemporaryDirectory(prefix="megatron-rl-datasets-") as cache, _quiet_progress(datasets):
        try:
            dataset = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache)
        except Exception as exc:
            if "corresponds to no data" in str(exc):  # a CSV with only its header line
                raise _empty(str(path), key, split_hint=False) from None
            raise _read_error(path, f"{builder} (the {builder!r} builder)", exc) from exc
        return _rows(dataset, str(path), key, fields, keep_columns, split_hint=False, max_row_bytes=max_row_bytes)


def _top_column(field_key: str, column_names: list[str]) -> str:
    # As get_field: a column literally named "a.b" wins over the dotted walk into column "a".
    return field_key if field_key in column_names else field_key.split(".", 1)[0]


def _check_columns(column_names: list[str], source: str, fields: list[tuple[str, str]]) -> None:
    """Every configured field must start at a column of the dataset."""
    for label, field_key in fields:
        top = _top_column(field_key, column_names)
        if top not in column_names:
            available = ", ".join(repr(name) for name in column_names)
            raise ConfigError(
                f"{source}: {label} '{field_key}': the dataset has no column '{top}'; its columns are "
                f"{available}. Use one of them in {label}"
            )


def _rows(dataset, source: str, key: str, fields: list[tuple[str, str]], keep_columns: list[str] | None,
          split_hint: bool, max_row_bytes: int) -> list[dict]:
    if len(dataset) == 0:
        raise _empty(source, key, split_hint)
    _check_columns(dataset.column_names, source, fields)
    if keep_columns is not None:
        # data.other_columns=drop: skip decoding columns nobody reads (images, long documents).
        dataset = dataset.select_columns(sorted({_top_column(k, dataset.column_names) for k in keep_columns}))
    rows: list[dict] = []
    for start in range(0, len(dataset), BATCH_ROWS):  # a batch at a time: a refused dataset is never held whole
        batch = dataset[start:start + BATCH_ROWS]  # columns of Python values
        for offset, values in enumerate(zip(*batch.values())):
            row = dict(zip(batch, values))
            check_row(row, f"{source} row index {start + offset}", max_row_bytes)
            rows.append(row)
    return rows


def _configured_fields(prompt_key: str, answer_key: str | None, columns: Mapping[str, str]) -> list[tuple[str, str]]:
    """(config key, field) of every field a record reads."""
    fields = [("data.prompt_key", prompt_key)]
    if answer_key is not None:
        fields.append(("data.answer_key", answer_key))
    return fields + [("data.columns", source) for source in columns]


def load_hf_prompts(path: str | Path, *, key: str = "train", split: str = "train", prompt_key: str = "prompt",
                    answer_key: str | None = "answer", columns: Mapping[str, str] | None = None,
                    other_columns: str = "keep", max_line_bytes: int = 16 << 20):
    """A PromptDataset of a save_to_disk directory or a file read by ``load_dataset``, each row
    at most ``max_line_bytes`` of text (data.max_line_bytes).

    ``key`` is the data config key the path came from ("train" / "heldout"), for messages.
    """
    path = Path(path)
    columns = dict(columns or {})
    fields = _configured_fields(prompt_key, answer_key, columns)
    keep_columns = None if other_columns == "keep" else [field_key for _, field_key in fields]
    if path.is_dir():
        dataset, source, is_split = _saved_split(path, key, split)
        rows = _rows(dataset, source, key, fields, keep_columns, split_hint=is_split, max_row_bytes=max_line_bytes)
    else:
        source = str(path)
        rows = _file_rows(path, key, fields, keep_columns, max_line_bytes)
    keep_other = other_columns == "keep"
    records = [record_from_row(row, f"{source} row index {index}", prompt_key, answer_key, columns, keep_other)
               for index, row in enumerate(rows)]
    return PromptDataset(records, source)
