"""A HumanEval-format .jsonl.gz set is a file of a few kilobytes that decompresses to what a
model's rows hold: one that decompresses to more than humaneval.MAX_GZIP_BYTES in all (a
decompression bomb: every line within data.max_line_bytes, a 300 KB file held 300 MB in memory
and a 16 MB one would hold 16 GB) is refused by file and line after decompressing that much, before
any model. The same rows as a plain .jsonl are read (their size is what is on disk). The cap is
lowered here to 1 MiB so that the case stays small."""

from __future__ import annotations

import gzip
import json

import pytest

from megatron_rl.errors import ConfigError
from megatron_rl.evaluation import humaneval


def test_a_gzipped_set_that_decompresses_past_the_cap_is_refused_by_line(tmp_path, monkeypatch):
    monkeypatch.setattr(humaneval, "MAX_GZIP_BYTES", 1 << 20)
    row = json.dumps({"prompt": "def f():\n    " + "#" * (64 << 10), "test": "def check(c):\n    pass\n",
                      "entry_point": "f"}) + "\n"
    bomb = tmp_path / "bomb.jsonl.gz"
    with gzip.open(bomb, "wt") as handle:
        handle.write(row * 40)  # 2.6 MB in 40 lines from a file of a few kilobytes
    assert bomb.stat().st_size < 20_000
    with pytest.raises(ConfigError, match=r"bomb\.jsonl\.gz line 16: the file decompresses to more than 1048576 "
                                          r"bytes \(refused after decompressing that much of it\)"):
        humaneval.load_humaneval(bomb)
    plain = tmp_path / "plain.jsonl"
    plain.write_text(row * 40)
    assert len(humaneval.load_humaneval(plain)) == 40


@pytest.mark.parametrize("entry_point", ["class", "None", "lambda"])
def test_an_entry_point_that_is_a_python_keyword_is_refused_by_line(tmp_path, entry_point):
    """`check(class)` is no program: every sample of such a row failed with a SyntaxError, and the
    set scored 0 with no word of why (the name check took any identifier)."""
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps({"prompt": "def f():\n", "test": "def check(c):\n    pass\n",
                                "entry_point": entry_point}) + "\n")
    with pytest.raises(ConfigError, match=rf"set\.jsonl line 1: entry_point '{entry_point}' is not a Python function"):
        humaneval.load_humaneval(path)
