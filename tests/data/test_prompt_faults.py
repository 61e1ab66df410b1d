"""Bad prompt data fails at start-up, by name: a line that is not UTF-8, a blank prompt, and a
prompt too long for the engine (preflight, data.overlong_prompts: error | drop).

The length checks run the real preflight on a model directory holding the built-in tiny default's
config and its character tokenizer (one token per character, plus BOS in front), so the expected
token counts come from the same tokenizer and encode_prompt the trainer uses. No model is built
and no engine started: everything here happens before that.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from _support.processes import REPO, child_env, cli_command
from megatron_rl.config import load_config
from megatron_rl.data import DataConfig, encode_prompt, load_datasets, write_char_tokenizer
from megatron_rl.errors import ConfigError
from megatron_rl.model.hf_config import load_hf_config
from megatron_rl.rollout.engine_model import load_engine_tokenizer
from megatron_rl.train.preflight import preflight

pytestmark = pytest.mark.subprocess  # runs a child process (pyproject's marks; scripts/test.sh --quick)

# rollout.max_model_len - rl.max_response_tokens: the longest prompt the engine can take and answer.
MAX_MODEL_LEN, MAX_RESPONSE = 64, 6
LIMIT = MAX_MODEL_LEN - MAX_RESPONSE
LIMIT_TERMS = f"rollout.max_model_len={MAX_MODEL_LEN} - rl.max_response_tokens={MAX_RESPONSE}"


def write_jsonl(path: Path, prompts: list) -> Path:
    path.write_text("".join(json.dumps({"prompt": prompt, "answer": "1"}) + "\n" for prompt in prompts))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny default model as a Hugging Face directory: its config and its tokenizer."""
    directory = tmp_path_factory.mktemp("tiny-model")
    raw, _ = load_hf_config(load_config(None).model.hf_config)
    (directory / "config.json").write_text(json.dumps(raw))
    write_char_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_engine_tokenizer(model_dir)


def run_config(tmp_path: Path, model_dir: Path, train: Path, *overrides: str):
    return load_config(None, [
        f"output_dir={tmp_path / 'run'}", f"model.hf_config={model_dir}", f"data.train={train}",
        f"rollout.max_model_len={MAX_MODEL_LEN}", f"rl.max_response_tokens={MAX_RESPONSE}",
        "warm_start.steps=0", "logging.wandb_mode=disabled", *overrides,
    ])


def tokens(tokenizer, prompt, prompt_format: str = "raw") -> int:
    return len(encode_prompt(tokenizer, prompt, prompt_format=prompt_format))


# Train prompts: lines 2 and 5 are over the limit; line 4 is exactly at it (allowed).
TRAIN = ["1+1=", "9" * 70, "2+2=", "7" * (LIMIT - 1), "8" * 80, "3+3="]
HELDOUT = ["6" * 60, "4+4="]


@pytest.fixture
def prompt_files(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", TRAIN), write_jsonl(tmp_path / "heldout.jsonl", HELDOUT)


# --------------------------------------------------------------------------- prompt lengths


def test_overlong_prompts_refuse_the_run_naming_file_line_and_numbers(tmp_path, model_dir, tokenizer, prompt_files):
    train, heldout = prompt_files
    assert tokens(tokenizer, TRAIN[3]) == LIMIT  # the boundary: at the limit is allowed
    with pytest.raises(ConfigError) as refused:
        preflight(run_config(tmp_path, model_dir, train, f"data.heldout={heldout}"))
    message = str(refused.value)
    assert message.startswith(f"{train} line 2: the prompt is {tokens(tokenizer, TRAIN[1])} tokens, over the limit "
                              f"of {LIMIT} ({LIMIT_TERMS}; counted with the run's tokenizer, "
                              "data.prompt_format=raw)"), message
    assert "3 prompts are over it in all (data.train: 2 of 6, data.heldout: 1 of 2)" in message, message
    assert f"{train} line 5 ({tokens(tokenizer, TRAIN[4])} tokens)" in message, message
    assert f"{heldout} line 1 ({tokens(tokenizer, HELDOUT[0])} tokens)" in message, message
    assert f"{train} line 4" not in message, message
    assert "data.overlong_prompts=drop" in message, message
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_drop_leaves_them_out_and_prints_how_many(tmp_path, model_dir, prompt_files, capsys):
    train, heldout = prompt_files
    kept_train, kept_heldout = preflight(run_config(tmp_path, model_dir, train, f"data.heldout={heldout}",
                                                    "data.overlong_prompts=drop"))
    assert [record.prompt for record in kept_train] == [TRAIN[0], TRAIN[2], TRAIN[3], TRAIN[5]]
    assert [record.location for record in kept_train] == [f"{train} line {n}" for n in (1, 3, 4, 6)]
    assert [record.prompt for record in kept_heldout] == [HELDOUT[1]]
    printed = [line for line in capsys.readouterr().out.splitlines() if "dropped" in line]
    assert printed == [
        f"megatron-rl: data.overlong_prompts=drop: dropped 2 of 6 prompts of {train} (data.train), longer than "
        f"{LIMIT} tokens ({LIMIT_TERMS}); 4 left",
        f"megatron-rl: data.overlong_prompts=drop: dropped 1 of 2 prompts of {heldout} (data.heldout), longer than "
        f"{LIMIT} tokens ({LIMIT_TERMS}); 1 left",
    ]


def test_drop_refuses_to_empty_a_dataset(tmp_path, model_dir):
    train = write_jsonl(tmp_path / "long.jsonl", ["9" * 70, "8" * 90])
    with pytest.raises(ConfigError, match=rf"data.train: every one of the 2 prompts of {train} is over the limit "
                                          rf"of {LIMIT} tokens .*would leave nothing"):
        preflight(run_config(tmp_path, model_dir, train, "data.overlong_prompts=drop"))


def test_chat_format_counts_the_template(tmp_path, model_dir, tokenizer):
    # Short enough as raw text; the chat template's tokens put it over the limit.
    prompt = "5" * 50
    assert tokens(tokenizer, prompt) <= LIMIT < tokens(tokenizer, prompt, "chat")
    train = write_jsonl(tmp_path / "chat.jsonl", ["1+1=", prompt])
    with pytest.raises(ConfigError) as refused:
        preflight(run_config(tmp_path, model_dir, train, "data.prompt_format=chat"))
    assert str(refused.value).startswith(
        f"{train} line 2: the prompt is {tokens(tokenizer, prompt, 'chat')} tokens, over the limit of {LIMIT}"), refused.value


def test_a_response_that_fills_the_context_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.max_model_len=6 leaves no room for a prompt next to "
                                          r"rl.max_response_tokens=6"):
        preflight(load_config(None, [f"output_dir={tmp_path / 'run'}", "rollout.max_model_len=6",
                                     "rl.max_response_tokens=6", "warm_start.steps=0"]))


# --------------------------------------------------------------------------- encoding and blank prompts


def non_utf8_file(tmp_path: Path) -> tuple[Path, int]:
    """A JSONL file whose line 2 holds a Latin-1 byte, and that byte's offset in the file."""
    first = b'{"prompt": "1+1=", "answer": "2"}\n'
    second = b'{"prompt": "caf\xe9 2+2=", "answer": "4"}\n'
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(first + second)
    return path, len(first) + second.index(b"\xe9")


def test_non_utf8_line_is_refused_naming_file_line_and_offset(tmp_path):
    path, offset = non_utf8_file(tmp_path)
    with pytest.raises(ConfigError) as refused:
        load_datasets(DataConfig(train=str(path)))
    message = str(refused.value)
    assert message.startswith(f"{path} line 2: not valid UTF-8 (byte b'\\xe9' at byte offset {offset} of the file"), message
    assert "re-encode the file as UTF-8" in message, message


def test_non_utf8_line_exits_2_through_the_cli(tmp_path):
    path, _ = non_utf8_file(tmp_path)
    result = subprocess.run(
        cli_command("train", f"output_dir={tmp_path / 'run'}", f"data.train={path}", "logging.wandb_mode=disabled"),
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env=child_env(),
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-4000:]
    assert f"megatron-rl: configuration error: {path} line 2: not valid UTF-8" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "run").exists(), "a run refused at start-up must not write anything"


def saved_dataset(tmp_path: Path, prompts: list) -> tuple[Path, str]:
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "saved"
    datasets.disable_progress_bars()
    try:
        datasets.Dataset.from_dict({"prompt": prompts, "answer": ["1"] * len(prompts)}).save_to_disk(str(path))
    finally:
        datasets.enable_progress_bars()
    return path, f"{path} row index 1"


def parquet_file(tmp_path: Path, prompts: list) -> tuple[Path, str]:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": prompts, "answer": ["1"] * len(prompts)}), path)
    return path, f"{path} row index 1"


def jsonl_file(tmp_path: Path, prompts: list) -> tuple[Path, str]:
    return write_jsonl(tmp_path / "p.jsonl", prompts), f"{tmp_path / 'p.jsonl'} line 2"


BLANK_CHAT = [{"role": "system", "content": ""}, {"role": "user", "content": " \n\t"}]


@pytest.mark.parametrize("source, blank", [
    (jsonl_file, "  \t "),
    (jsonl_file, "\n"),
    (jsonl_file, BLANK_CHAT),
    (parquet_file, "   "),
    (saved_dataset, "\n \n"),
], ids=["jsonl-spaces", "jsonl-newline", "jsonl-chat", "parquet", "save_to_disk"])
def test_blank_prompts_are_refused_naming_the_row(tmp_path, source, blank):
    path, where = source(tmp_path, ["1+1=", blank])
    with pytest.raises(ConfigError, match=rf"^{where}: prompt key 'prompt': the prompt is empty or only whitespace"):
        load_datasets(DataConfig(train=str(path)))


def test_a_blank_message_beside_a_real_one_is_kept(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [[{"role": "system", "content": ""}, {"role": "user", "content": "1+1="}]])
    train, _ = load_datasets(DataConfig(train=str(path)))
    assert train[0].prompt[1]["content"] == "1+1=" and train[0].location == f"{path} line 1"


# --------------------------------------------------------------------------- untrusted sizes and nesting (issue 57)


def test_a_huge_prompt_is_refused_without_the_tokenizer_seeing_it_whole(tmp_path, model_dir, tokenizer, monkeypatch):
    """A 20 MB prompt (one of 50 MB held 6 GB in the tokenizer after 28 s, then was refused) and
    one of 2,000 characters are refused by line with a count from below: the first by its length
    alone (no token of the run's tokenizer stands for more than its longest entry's characters),
    the second on a bounded prefix. The tokenizer sees at most that prefix of any prompt; a
    prompt that can fit is still counted exactly, and drop leaves the long ones out."""
    from megatron_rl.train import preflight as checks

    seen: list[int] = []
    count = checks.token_counts
    monkeypatch.setattr(checks, "token_counts",
                        lambda tok, texts, special: seen.extend(map(len, texts)) or count(tok, texts, special))
    train = write_jsonl(tmp_path / "huge.jsonl", ["1+1=", "9" * 20_000_000, "8" * 2000, "7" * (LIMIT - 1)])
    with pytest.raises(ConfigError) as refused:
        preflight(run_config(tmp_path, model_dir, train, "data.max_line_bytes=33554432"))
    message = str(refused.value)
    per_token = checks.longest_token_chars(tokenizer) * checks.NORMALIZATION_SHRINK
    prefix = checks.PREFIX_CHARS_PER_TOKEN * (LIMIT + checks.CUT_MARGIN + 1)
    assert message.startswith(f"{train} line 2: the prompt is at least {-(-20_000_000 // per_token)} tokens, over "
                              f"the limit of {LIMIT}"), message
    assert f"{train} line 3 (at least {tokens(tokenizer, '8' * prefix) - checks.CUT_MARGIN} tokens)" in message, message
    assert f"{train} line 4" not in message, message
    assert max(seen) <= prefix, max(seen)  # never the 20 MB, nor the 2,000 characters whole
    kept, _ = preflight(run_config(tmp_path, model_dir, train, "data.max_line_bytes=33554432",
                                   "data.overlong_prompts=drop"))
    assert [record.location for record in kept] == [f"{train} line 1", f"{train} line 4"]


def test_a_line_longer_than_max_line_bytes_is_refused_after_reading_only_that_much(tmp_path, monkeypatch):
    """A 20 MB line against the default data.max_line_bytes (16 MiB): refused by file and line
    naming the key, with no read of the file returning more than the limit (a file with no line
    breaks at all would otherwise be read whole into memory)."""
    path = write_jsonl(tmp_path / "p.jsonl", ["1+1=", "9" * 20_000_000, "2+2="])
    limit = DataConfig().max_line_bytes
    reads: list[int] = []
    real_open = Path.open

    class Spy:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def readline(self, size=-1):
            line = self.handle.readline(size)
            reads.append(len(line))
            return line

        def __iter__(self):
            for line in self.handle:
                reads.append(len(line))
                yield line

    monkeypatch.setattr(Path, "open", lambda self, *a, **k: Spy(real_open(self, *a, **k)) if self == path
                        else real_open(self, *a, **k))
    with pytest.raises(ConfigError, match=rf"^{path} line 2: longer than data.max_line_bytes={limit} bytes "
                                          r"\(refused after reading that much of it\).*raise data.max_line_bytes"):
        load_datasets(DataConfig(train=str(path)))
    assert max(reads) <= limit + 1, max(reads)
    train, _ = load_datasets(DataConfig(train=str(path), max_line_bytes=32 << 20))  # raised: read as it is
    assert len(train[1].prompt) == 20_000_000


def deep_row(levels: int) -> str:
    return '{"prompt": "1+1=", "answer": "2", "extra": ' + "[" * (levels - 1) + "]" * (levels - 1) + "}"


@pytest.mark.parametrize("levels", [100_000, 150])
def test_a_row_nested_too_deep_is_refused_by_line(tmp_path, levels):
    """100,000 nested arrays raised RecursionError out of the JSON parser (a traceback); 150 parse,
    but nothing a prompt row holds nests that deep, and copying or pickling such metadata recurses
    as the parser does. Both are refused by file and line; 100 levels are read."""
    from megatron_rl.data.prompts import MAX_JSON_DEPTH

    path = tmp_path / "deep.jsonl"
    path.write_text(deep_row(2) + "\n" + deep_row(levels) + "\n")
    with pytest.raises(ConfigError, match=rf"^{path} line 2: nested more than {MAX_JSON_DEPTH} levels deep"):
        load_datasets(DataConfig(train=str(path)))
    path.write_text(deep_row(MAX_JSON_DEPTH) + "\n")
    train, _ = load_datasets(DataConfig(train=str(path)))
    assert train[0].metadata["extra"]


def test_a_row_nested_too_deep_exits_2_through_the_cli(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text(deep_row(2) + "\n" + deep_row(100_000) + "\n")
    result = subprocess.run(
        cli_command("train", f"output_dir={tmp_path / 'run'}", f"data.train={path}", "logging.wandb_mode=disabled"),
        capture_output=True, text=True, timeout=300, cwd=REPO, env=child_env(),
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-4000:]
    assert f"megatron-rl: configuration error: {path} line 2: nested more than" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
