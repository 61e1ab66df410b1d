"""Prompt files (JSONL, Parquet) and synthetic datasets: records, dotted keys, and error messages."""

from __future__ import annotations

import json
import sys

import pytest

from megatron_rl.errors import ConfigError
from megatron_rl.data.config import DataConfig
from megatron_rl.data.prompts import get_field, load_datasets, load_prompts, prompt_text, synthetic_datasets
from megatron_rl.rewards.synthetic import TaskConfig


def write_jsonl(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def test_jsonl_records_keys_and_metadata(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"question": "1+1?", "solution": {"final": 2}, "source": "toy", "answer": "ignored"},
        "",  # blank lines are skipped
        {"question": [{"role": "user", "content": "2+2?"}], "solution": {"final": "4"}, "source": "toy"},
    ])
    data = load_prompts(path, prompt_key="question", answer_key="solution.final")
    assert len(data) == 2 and data.source == str(path)
    assert data[0].prompt == "1+1?" and data[0].answer == "2"  # numeric answers become text
    # Other top-level fields are metadata; "answer" is reserved for the reward's own argument.
    assert data[0].metadata == {"solution": {"final": 2}, "source": "toy"}
    assert data[1].prompt == ({"role": "user", "content": "2+2?"},)
    assert prompt_text(data[1].prompt) == "2+2?"
    assert [r.answer for r in data.select([1, 0])] == ["4", "2"]


def test_no_answer_key(tmp_path):
    data = load_prompts(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}]), answer_key=None)
    assert data[0].answer is None


def test_get_field_walks_mappings_and_lists():
    row = {"a": {"b": [{"c": 1}, {"c": 2}]}, "x.y": 3}
    assert get_field(row, "a.b.1.c") == 2
    assert get_field(row, "x.y") == 3  # a literal dotted field name wins
    with pytest.raises(KeyError, match="missing key 'd' under 'a'; it has 'b'"):
        get_field(row, "a.d")


@pytest.mark.parametrize(
    "rows, kwargs, message",
    [
        ([{"prompt": "a", "answer": "1"}, {"prompt": "b"}], {},
         r"p.jsonl line 2: answer key 'answer': missing key 'answer' at the top level; it has 'prompt'"),
        ([{"prompt": "a", "answer": "1"}, "", "{not json"], {}, r"p.jsonl line 3: not valid JSON"),
        ([{"q": {"text": "a"}, "answer": "1"}], {"prompt_key": "q.body"},
         r"p.jsonl line 1: prompt key 'q.body': missing key 'body' under 'q'"),
        ([{"prompt": 5, "answer": "1"}], {}, r"line 1: prompt key 'prompt': the prompt must be a string or a list"),
        ([{"prompt": "", "answer": "1"}], {}, r"line 1: prompt key 'prompt': the prompt is empty"),
        ([{"prompt": [{"role": "user"}], "answer": "1"}], {}, r"line 1: .*chat message 0 must be a mapping"),
        ([{"prompt": "a", "answer": None}], {},
         r"line 1: answer key 'answer': the answer must be a string or a number"),
        (["[1, 2]"], {}, r"line 1: expected an object with fields, got list"),
        ([], {}, r"p.jsonl: no prompt records"),
    ],
)
def test_jsonl_errors_name_file_line_and_key(tmp_path, rows, kwargs, message):
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(ConfigError, match=message):
        load_prompts(path, **kwargs)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match=r"unsupported prompt file type '.csv'; use .jsonl or .parquet"):
        load_prompts(tmp_path / "p.csv")


@pytest.mark.timeout(60)  # a FIFO opened to read blocks until a writer comes: never here
def test_a_path_that_exists_but_is_not_a_regular_file_is_named_so_and_never_opened(tmp_path):
    """A FIFO or a device named like a prompt file (data.train, data.heldout, load_prompts) is
    refused as what it is, not as a file that "does not exist", and is not opened (a FIFO would
    block the run at start-up, /dev/zero never end); so is a recipe (--config) or a reward file."""
    import os

    from megatron_rl.config import load_config
    from megatron_rl.data.prompts import load_source
    from megatron_rl.rewards.registry import resolve_reward

    fifo, device = tmp_path / "fifo.jsonl", tmp_path / "zero.jsonl"
    os.mkfifo(fifo)
    device.symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo.json")  # a `datasets` file type
    for path in (fifo, device, tmp_path / "fifo.json"):
        with pytest.raises(ConfigError) as caught:
            load_source(DataConfig(train=str(path)), "train")
        assert str(caught.value) == (f"data.train: prompt file {path} is not a regular file (a FIFO, device or "
                                     "socket); it must be a file or a directory written by `datasets` save_to_disk")
    for path in (fifo, device):
        with pytest.raises(ConfigError, match=f"^prompt file {path} is not a regular file"):
            load_prompts(path)
    os.mkfifo(tmp_path / "recipe.yaml")
    with pytest.raises(ConfigError, match=f"^config file {tmp_path / 'recipe.yaml'} is not a regular file"):
        load_config(tmp_path / "recipe.yaml")
    os.mkfifo(tmp_path / "reward.py")
    with pytest.raises(ConfigError, match=f"file {tmp_path / 'reward.py'} is not a regular file"):
        resolve_reward(f"{tmp_path / 'reward.py'}:score")


def test_parquet_records_and_errors(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"prompt": "a", "reward_model": {"ground_truth": "1"}, "data_source": "x"},
        {"prompt": "b", "reward_model": {"ground_truth": "2"}, "data_source": "y"},
    ]), path)
    data = load_prompts(path, answer_key="reward_model.ground_truth")
    assert [(r.prompt, r.answer, r.metadata["data_source"]) for r in data] == [("a", "1", "x"), ("b", "2", "y")]
    with pytest.raises(ConfigError, match=r"p.parquet row index 0: answer key 'solution': missing key 'solution'"):
        load_prompts(path, answer_key="solution")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ConfigError, match="not a readable Parquet file"):
        load_prompts(tmp_path / "bad.parquet")


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    path = tmp_path / "p.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # makes the import fail
    with pytest.raises(ConfigError, match=r"p.parquet: reading Parquet needs pyarrow; install it with `pip install"):
        load_prompts(path)


def test_synthetic_datasets_are_disjoint_and_deterministic():
    task = TaskConfig(task="add", digits=2)
    train, heldout = synthetic_datasets(task, num_train=2000, num_heldout=100, seed=0)
    assert len(train) == 2000 and len(heldout) == 100
    assert not {r.prompt for r in train} & {r.prompt for r in heldout}
    assert train[0].metadata == {"task": "add", "response_format": "plain", "target": train[0].answer}
    again, _ = synthetic_datasets(task, num_train=2000, num_heldout=0, seed=0)
    assert list(again) == list(train)


def test_load_datasets_from_config(tmp_path):
    train, heldout = load_datasets(DataConfig(num_train=64, num_heldout=16))
    assert len(train) == 64 and len(heldout) == 16 and train.source.startswith("synthetic task 'add'")
    path = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    train, heldout = load_datasets(DataConfig(num_train=8, heldout=str(path)))
    assert len(train) == 8 and heldout[0].answer == "2"
    train, heldout = load_datasets(DataConfig(train=str(path)))
    assert len(train) == 1 and heldout is None


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"prompt_format": "json"}, r"data.prompt_format must be one of raw, chat"),
        ({"system_prompt": "be brief"}, r"data.system_prompt needs prompt_format='chat'"),
        ({"num_train": 0}, r"data.num_train must be >= 1"),
        ({"answer_key": ""}, r"data.answer_key must be a field name or null"),
        ({"synthetic": TaskConfig(digits=0)}, r"data.synthetic.digits must be in \[1, 9\]"),
    ],
)
def test_data_config_errors_name_the_key(settings, message):
    with pytest.raises(ConfigError, match=message):
        DataConfig(**settings).validate()
