"""Prompt datasets through the `datasets` library: save_to_disk directories (Dataset and
DatasetDict splits), json / csv / parquet / arrow files via load_dataset, column mapping, and the
error messages (missing split, column, path; empty datasets)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_rl.config import load_config

from megatron_rl.errors import ConfigError
from megatron_rl.data.config import DataConfig
from megatron_rl.data.prompts import load_datasets, load_prompts

datasets = pytest.importorskip("datasets")

ROWS = {
    "question": ["1+1=", "2+3=", "4*4="],
    "solution": [2, 5, 16],  # numbers: the answer text is their str()
    "level": ["easy", "easy", "hard"],
    "source": ["toy", "toy", "toy"],
    "meta": [{"id": "a"}, {"id": "b"}, {"id": "c"}],
}
KEYS = {"prompt_key": "question", "answer_key": "solution"}


@pytest.fixture(autouse=True)
def quiet_datasets():
    # save_to_disk draws progress bars; the loader turns them off for itself only.
    datasets.disable_progress_bars()
    yield
    datasets.enable_progress_bars()


def saved_dict(tmp_path):
    path = tmp_path / "dd"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict(ROWS),
        "test": datasets.Dataset.from_dict({k: v[:1] for k, v in ROWS.items()} | {"question": ["9-1="]}),
    }).save_to_disk(str(path))
    return path


def answers(data):
    return [(r.prompt, r.answer) for r in data]


def test_saved_dataset_directory(tmp_path):
    path = tmp_path / "ds"
    datasets.Dataset.from_dict(ROWS).save_to_disk(str(path))
    train, heldout = load_datasets(DataConfig(train=str(path), **KEYS))
    assert heldout is None and train.source == str(path)
    assert answers(train) == [("1+1=", "2"), ("2+3=", "5"), ("4*4=", "16")]
    assert train[2].metadata == {"level": "hard", "source": "toy", "meta": {"id": "c"}}
    # A directory holding one Dataset has no splits: the split keys are not used.
    train, _ = load_datasets(DataConfig(train=str(path), train_split="other", **KEYS))
    assert len(train) == 3


def test_dataset_dict_splits(tmp_path):
    path = saved_dict(tmp_path)
    train, heldout = load_datasets(DataConfig(train=str(path), heldout=str(path), **KEYS))
    assert train.source == f"{path} split 'train'" and heldout.source == f"{path} split 'test'"
    assert answers(train)[1] == ("2+3=", "5") and answers(heldout) == [("9-1=", "2")]
    train, _ = load_datasets(DataConfig(train=str(path), train_split="test", **KEYS))
    assert answers(train) == [("9-1=", "2")]


def test_missing_split_names_the_splits(tmp_path):
    path = saved_dict(tmp_path)
    with pytest.raises(ConfigError, match=rf"data.heldout_split: {path} has no split 'validation'; "
                                          r"its splits are 'train', 'test'"):
        load_datasets(DataConfig(train=str(path), heldout=str(path), heldout_split="validation", **KEYS))


def test_column_mapping_and_dropping_other_columns(tmp_path):
    path = saved_dict(tmp_path)
    data, _ = load_datasets(DataConfig(train=str(path), columns={"level": "difficulty", "meta.id": "row_id"}, **KEYS))
    # Renamed fields appear under their new name only; the others keep theirs.
    assert data[2].metadata == {"difficulty": "hard", "row_id": "c", "source": "toy", "meta": {"id": "c"}}
    data, _ = load_datasets(DataConfig(train=str(path), columns={"level": "difficulty", "source": "source"},
                                       other_columns="drop", **KEYS))
    assert [r.metadata for r in data] == [{"difficulty": d, "source": "toy"} for d in ("easy", "easy", "hard")]
    assert answers(data)[0] == ("1+1=", "2")  # prompt and answer are read even when dropped from metadata


def test_column_mapping_applies_to_the_builtin_reader_too(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": "a", "answer": "1", "lvl": 3, "x": 0}) + "\n" for _ in range(2)))
    data = load_prompts(path, columns={"lvl": "level"})
    assert data[0].metadata == {"level": 3, "x": 0}
    data, _ = load_datasets(DataConfig(train=str(path), columns={"lvl": "level"}, other_columns="drop"))
    assert data[0].metadata == {"level": 3}
    with pytest.raises(ConfigError, match=r"p.jsonl line 1: data.columns renames 'lvl' to 'x', but the row also has"):
        load_prompts(path, columns={"lvl": "x"})
    with pytest.raises(ConfigError, match=r"p.jsonl line 1: data.columns key 'nope': missing key 'nope'"):
        load_prompts(path, columns={"nope": "n"})


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".csv", ".parquet", ".arrow"])
def test_files_through_load_dataset(tmp_path, suffix):
    flat = {k: v for k, v in ROWS.items() if k != "meta"}  # CSV has no nested values
    dataset = datasets.Dataset.from_dict(flat)
    path = tmp_path / f"prompts{suffix}"
    if suffix in (".json", ".jsonl"):
        dataset.to_json(str(path))
    elif suffix == ".csv":
        dataset.to_csv(str(path), index=False)
    elif suffix == ".parquet":
        dataset.to_parquet(str(path))
    else:
        saved = tmp_path / "saved"
        dataset.save_to_disk(str(saved))
        path = next(saved.glob("*.arrow")).rename(path)
    settings = dict(train=str(path), columns={"level": "difficulty"}, **KEYS)
    train, _ = load_datasets(DataConfig(loader="datasets", **settings))
    assert answers(train) == [("1+1=", "2"), ("2+3=", "5"), ("4*4=", "16")] and train.source == str(path)
    assert train[2].metadata == {"difficulty": "hard", "source": "toy"}
    # "auto": .json, .csv and .arrow go to `datasets` too; .jsonl / .parquet to the built-in
    # reader, which must give the same records.
    auto, _ = load_datasets(DataConfig(**settings))
    assert list(auto) == list(train)


def test_auto_keeps_the_builtin_reader_for_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n{not json\n")
    with pytest.raises(ConfigError, match=r"p.jsonl line 2: not valid JSON"):  # the built-in reader's message
        load_datasets(DataConfig(train=str(path)))
    with pytest.raises(ConfigError, match=r"p.jsonl: `datasets` could not read it as json"):
        load_datasets(DataConfig(train=str(path), loader="datasets"))


def test_missing_column_names_the_column_and_the_available_ones(tmp_path):
    path = saved_dict(tmp_path)
    with pytest.raises(ConfigError, match=rf"{path} split 'train': data.prompt_key 'prompt': the dataset has no "
                                          r"column 'prompt'; its columns are 'question', 'solution', 'level', "
                                          r"'source', 'meta'. Use one of them in data.prompt_key"):
        load_datasets(DataConfig(train=str(path), answer_key="solution"))
    with pytest.raises(ConfigError, match=r"data.answer_key 'answer.value': the dataset has no column 'answer'"):
        load_datasets(DataConfig(train=str(path), prompt_key="question", answer_key="answer.value"))
    with pytest.raises(ConfigError, match=r"data.columns 'lvl': the dataset has no column 'lvl'"):
        load_datasets(DataConfig(train=str(path), columns={"lvl": "level"}, **KEYS))


def test_wrong_types_name_the_row(tmp_path):
    path = tmp_path / "ds"
    datasets.Dataset.from_dict({"question": ["ok", ""], "solution": [1, 2]}).save_to_disk(str(path))
    with pytest.raises(ConfigError, match=rf"{path} row index 1: prompt key 'question': the prompt is empty"):
        load_datasets(DataConfig(train=str(path), **KEYS))
    path = tmp_path / "ds2"
    datasets.Dataset.from_dict({"question": ["ok"], "solution": [[1, 2]]}).save_to_disk(str(path))
    with pytest.raises(ConfigError, match=r"row index 0: answer key 'solution': the answer must be a string"):
        load_datasets(DataConfig(train=str(path), **KEYS))


def test_empty_datasets(tmp_path):
    path = tmp_path / "dd"
    full = datasets.Dataset.from_dict({"question": ["a"], "solution": [1]})
    # Built empty (save_to_disk writes no data file) and filtered empty (a data file of no rows).
    datasets.DatasetDict({"train": full, "test": datasets.Dataset.from_dict({"question": [], "solution": []}),
                          "filtered": full.filter(lambda row: False)}).save_to_disk(str(path))
    train, _ = load_datasets(DataConfig(train=str(path), **KEYS))  # the empty splits do not matter here
    assert answers(train) == [("a", "1")]
    for split in ("test", "filtered"):
        with pytest.raises(ConfigError, match=rf"{path} split '{split}': the dataset has no rows; point "
                                              r"data.heldout_split at a split with prompts"):
            load_datasets(DataConfig(train=str(path), heldout=str(path), heldout_split=split, **KEYS))
    for name, text in (("e.json", ""), ("e.csv", "question,solution\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=rf"{name}: the dataset has no rows; point data.train at a dataset"):
            load_datasets(DataConfig(train=str(tmp_path / name), **KEYS))


def test_paths_that_are_not_local_datasets(tmp_path):
    with pytest.raises(ConfigError, match=r"data.train: prompt file openai/gsm8k does not exist; it must be a local "
                                          r"file \(.arrow, .csv, .json, .jsonl, .parquet\) or a directory written by "
                                          r"`datasets` save_to_disk .*save_to_disk\(DIR\)"):
        load_datasets(DataConfig(train="openai/gsm8k"))
    with pytest.raises(ConfigError, match=rf"data.heldout: prompt file {tmp_path}/missing.jsonl does not exist"):
        load_datasets(DataConfig(heldout=str(tmp_path / "missing.jsonl")))
    with pytest.raises(ConfigError, match=r"data.train: .* is a directory but not one written by `datasets`"):
        load_datasets(DataConfig(train=str(tmp_path)))
    with pytest.raises(ConfigError, match=r"data.loader=builtin reads .jsonl / .parquet files only"):
        load_datasets(DataConfig(train=str(tmp_path), loader="builtin"))
    (tmp_path / "p.txt").write_text("hi\n")
    with pytest.raises(ConfigError, match=r"data.train: unsupported prompt file type '.txt'"):
        load_datasets(DataConfig(train=str(tmp_path / "p.txt")))
    (tmp_path / "p.csv").write_text("prompt,answer\na,1\n")
    with pytest.raises(ConfigError, match=r"unsupported prompt file type '.csv'; use .jsonl or .parquet"):
        load_datasets(DataConfig(train=str(tmp_path / "p.csv"), loader="builtin"))


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"loader": "hub"}, r"data.loader must be one of auto, builtin, datasets"),
        ({"train_split": ""}, r"data.train_split must be a non-empty split name"),
        ({"columns": {"level": "answer"}}, r"data.columns.level: 'answer' is a reward function's own argument"),
        ({"columns": {"level": "not a name"}}, r"data.columns.level must be a Python identifier"),
        ({"columns": {"a": "x", "b": "x"}}, r"data.columns: 'a' and 'b' are both renamed to 'x'"),
        ({"other_columns": "some"}, r"data.other_columns must be 'keep' or 'drop'"),
    ],
)
def test_data_config_errors(settings, message):
    with pytest.raises(ConfigError, match=message):
        DataConfig(**settings).validate()


def test_run_config_reads_column_mappings(tmp_path):
    recipe = tmp_path / "run.yaml"
    recipe.write_text("data:\n  loader: datasets\n  columns: {level: difficulty}\n  other_columns: drop\n")
    config = load_config(recipe, ["data.columns.source=origin", "data.heldout_split=validation"])
    assert config.data.columns == {"level": "difficulty", "source": "origin"}
    assert (config.data.loader, config.data.other_columns, config.data.heldout_split) == ("datasets", "drop",
                                                                                         "validation")
    with pytest.raises(ConfigError, match=r"data.columns: expected a mapping, got \['level'\]"):
        load_config(None, ["data.columns=[level]"])
    with pytest.raises(ConfigError, match=r"data.columns.level: expected a string, got 3"):
        load_config(None, ["data.columns={level: 3}"])


def test_the_default_run_does_not_import_datasets():
    code = ("import sys; from megatron_rl.config import load_config; from megatron_rl.data import load_datasets; "
            "load_datasets(load_config(None).data); print('datasets' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
