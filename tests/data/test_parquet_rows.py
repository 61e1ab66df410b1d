"""A Parquet prompt file's rows are bounded by data.max_line_bytes as a JSONL line is, and a
compressed file is not decompressed whole before its rows are measured. Before, read_table
decompressed the whole file and no row was measured: a 2 KB file held a 50 MB prompt, accepted (a few
megabytes of rows, each under the bound, are still read whole: the rows' count is not bounded,
as a JSONL file's is not).
The bound is lowered to 1 MiB here so that the files stay small."""

from __future__ import annotations

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from megatron_rl.data.prompts import load_prompts  # noqa: E402  (after the importorskip)
from megatron_rl.errors import ConfigError  # noqa: E402

BOUND = 1 << 20


def write(path, prompts, row_group_size=None):
    table = pa.table({"prompt": prompts, "answer": ["2"] * len(prompts)})
    pq.write_table(table, path, compression="zstd", row_group_size=row_group_size)
    return path


def test_a_row_group_whose_rows_are_over_the_bound_on_average_is_refused_before_it_is_decompressed(tmp_path):
    path = write(tmp_path / "bomb.parquet", ["x" * (8 << 20)] + ["1+1="] * 4)
    assert path.stat().st_size < 10_000  # 8 MB of prompt in a few kilobytes
    with pytest.raises(ConfigError, match=r"bomb\.parquet rows 0 to 4: 8388\d{3} bytes uncompressed, more than "
                                          r"data\.max_line_bytes=1048576 bytes a row \(refused before decompressing"):
        load_prompts(path, max_line_bytes=BOUND)


def test_one_row_over_the_bound_among_small_ones_is_refused_by_its_index(tmp_path):
    prompts = ["1+1="] * 200
    prompts[130] = "y" * (BOUND + 1)
    path = write(tmp_path / "one.parquet", prompts)
    with pytest.raises(ConfigError, match=r"one\.parquet row index 130: longer than data\.max_line_bytes=1048576 "
                                          r"bytes \(its fields' text together\)"):
        load_prompts(path, max_line_bytes=BOUND)
    prompts[130] = "y" * (BOUND - 100)  # within the bound, with its answer: read
    records = load_prompts(write(tmp_path / "within.parquet", prompts, row_group_size=50), max_line_bytes=BOUND)
    assert len(records) == 200 and len(records[130].prompt) == BOUND - 100


def test_the_datasets_loader_bounds_a_parquet_files_rows_and_a_saved_datasets_rows_alike(tmp_path):
    """data.loader=datasets (and a save_to_disk directory, which only `datasets` reads): the same
    footer check before load_dataset decompresses the file into its cache, and the same bound on
    every row. Before, the whole dataset became Python rows and none was measured."""
    datasets = pytest.importorskip("datasets")
    from megatron_rl.data.hf_datasets import load_hf_prompts

    bomb = write(tmp_path / "bomb.parquet", ["x" * (8 << 20)] + ["1+1="] * 4)
    with pytest.raises(ConfigError, match=r"bomb\.parquet rows 0 to 4: 8388\d{3} bytes uncompressed, more than "
                                          r"data\.max_line_bytes=1048576 bytes a row \(refused before decompressing"):
        load_hf_prompts(bomb, max_line_bytes=BOUND)
    prompts = ["1+1="] * 100
    prompts[70] = "y" * (BOUND + 1)
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"prompt": prompts, "answer": ["2"] * 100}).save_to_disk(str(saved))
    with pytest.raises(ConfigError, match=r"saved row index 70: longer than data\.max_line_bytes=1048576 bytes"):
        load_hf_prompts(saved, max_line_bytes=BOUND)
    assert len(load_hf_prompts(saved, max_line_bytes=BOUND + 100)) == 100


def test_an_empty_row_group_is_read_as_no_rows(tmp_path):
    """A writer's empty last chunk (ParquetWriter.write_table of no rows) leaves a row group of 0
    rows whose footer still records a few bytes: nothing in it to bound. It was refused as rows 1
    to 0 over the bound (read_table had read such a file)."""
    table = pa.table({"prompt": ["1+1="], "answer": ["2"]})
    with pq.ParquetWriter(tmp_path / "chunked.parquet", table.schema) as writer:
        writer.write_table(table)
        writer.write_table(table.slice(0, 0))
    assert pq.ParquetFile(tmp_path / "chunked.parquet").metadata.row_group(1).num_rows == 0
    records = load_prompts(tmp_path / "chunked.parquet", max_line_bytes=BOUND)
    assert [(r.prompt, r.answer) for r in records] == [("1+1=", "2")]
