"""The rows of a Parquet prompt file, bounded as a JSONL line is (data.max_line_bytes).

Parquet compresses: a file of 2 KB held a 50 MB prompt, and a few megabytes can hold gigabytes
of rows, which reading the table whole (pyarrow.parquet.read_table) decompressed into memory
before any row was looked at; no row's size was checked at all. Here:

- the footer first: a row group whose uncompressed size (as the footer records it) exceeds its
  rows times `max_row_bytes` holds a row over the bound, so the file is refused before any of
  it is decompressed;
- then the rows in batches of BATCH_ROWS, each batch measured before its rows are handed on:
  a row whose text (strings and bytes of every field, nested ones included) exceeds
  `max_row_bytes` is refused by its 0-based row index, after at most one batch was decoded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from megatron_rl.errors import ConfigError

BATCH_ROWS = 64  # rows decoded at a time: a refused file is never held whole


def parquet_rows(path: Path, max_row_bytes: int) -> Iterator[tuple[str, Any]]:
    """(where, row) of every row of the Parquet file `path`; ConfigError naming the file (and
    row index) for an unreadable file or a row over `max_row_bytes`."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{path}: reading Parquet needs pyarrow; install it with `pip install pyarrow`") from None
    try:
        reader = pq.ParquetFile(path)
        metadata = reader.metadata
    except Exception as exc:  # pyarrow raises its own error types for corrupt or foreign files
        raise ConfigError(f"{path}: not a readable Parquet file: {type(exc).__name__}: {exc}") from exc
    check_row_groups(path, metadata, max_row_bytes)
    index = 0
    batches = reader.iter_batches(batch_size=BATCH_ROWS)
    while True:
        try:
            batch = next(batches, None)
        except Exception as exc:
            raise ConfigError(f"{path}: not a readable Parquet file: {type(exc).__name__}: {exc}") from exc
        if batch is None:
            return
        rows = batch.to_pylist()
        heavy = batch.nbytes > max_row_bytes  # else no row of the batch can be over the bound
        for row in rows:
            if heavy:
                check_row(row, f"{path} row index {index}", max_row_bytes)
            yield f"{path} row index {index}", row
            index += 1


def check_row_groups(path, metadata, max_row_bytes: int) -> None:
    """The footer's row groups (pyarrow FileMetaData): ConfigError naming the file and rows of one
    whose uncompressed size is over its rows times `max_row_bytes`, before any is decompressed."""
    first = 0
    for group in range(metadata.num_row_groups):
        rows, size = metadata.row_group(group).num_rows, metadata.row_group(group).total_byte_size
        if rows and size > rows * max_row_bytes:  # an empty group (a writer's empty chunk) holds no row
            raise ConfigError(f"{path} rows {first} to {first + rows - 1}: {size} bytes uncompressed, more than "
                              f"data.max_line_bytes={max_row_bytes} bytes a row (refused before decompressing them); "
                              "if a prompt row really is that large, raise data.max_line_bytes; otherwise fix the file")
        first += rows


def check_row(row: Any, where: str, max_row_bytes: int) -> None:
    """ConfigError naming `where` (the file and row) when the row's text is over `max_row_bytes`."""
    if _text_bytes(row) > max_row_bytes:
        raise ConfigError(f"{where}: longer than data.max_line_bytes={max_row_bytes} bytes (its fields' text "
                          "together); if a prompt row really is that large, raise data.max_line_bytes; otherwise "
                          "fix the file")


def _text_bytes(value: Any) -> int:
    """The bytes of the strings and byte strings in `value` (nested lists and mappings included),
    8 for any other value: a row's size as its JSON line would roughly be."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_bytes(key) + _text_bytes(item) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_text_bytes(item) for item in value)
    return 8
