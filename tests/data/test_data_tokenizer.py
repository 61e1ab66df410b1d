"""The tiny character tokenizer: AutoTokenizer round trip, exact text, coverage of every task."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from megatron_rl.errors import ConfigError
from megatron_rl.data.tokenizer import ALPHABET, SPECIAL_TOKENS, TOOL_TOKENS, build_char_tokenizer, write_char_tokenizer
from megatron_rl.rewards.synthetic import TASKS, make_task


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = write_char_tokenizer(tmp_path_factory.mktemp("tok") / "model")
    return directory, AutoTokenizer.from_pretrained(directory)


def test_autotokenizer_round_trip(saved):
    directory, tokenizer = saved
    assert len(tokenizer) == len(SPECIAL_TOKENS) + len(ALPHABET) + len(TOOL_TOKENS) == 99
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<|pad|>", "<|bos|>", "<|eos|>")
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    ids = tokenizer("12+7=19")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 1 + len("12+7=19")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12+7=19"
    assert tokenizer.decode(ids) == "<|bos|>12+7=19"
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # loadable by transformers 4 as well
    assert "extra_special_tokens" not in config


@pytest.mark.parametrize("text", ["a , b .", " x\n y ", "count a in abca=", r"\boxed{42}", "(1+2)*3%4=?!;:<>-/"])
def test_decode_adds_and_removes_no_spaces(saved, text):
    _, tokenizer = saved
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids_and_unknown_characters_map_to_unk(saved):
    _, tokenizer = saved
    assert tokenizer("<|im_start|>user", add_special_tokens=False)["input_ids"][0] == 4
    assert tokenizer("é€", add_special_tokens=False)["input_ids"] == [3, 3]


def test_ids_of_existing_tokens_never_change(saved):
    """Checkpoints depend on the ids: characters and tags are only ever appended."""
    _, tokenizer = saved
    vocab = tokenizer.get_vocab()
    first = "0123456789" + "+-*/%=()<>,.:;?! \n" + "\\{}" + "abcdefghijklmnopqrstuvwxyz"  # the 63-token build
    assert [vocab[c] for c in first] == list(range(6, 63))
    assert [vocab[c] for c in '"_[]'] == [63, 64, 65, 66]
    assert [vocab[c] for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ'#"] == list(range(67, 95))
    assert [vocab[t] for t in TOOL_TOKENS] == [95, 96, 97, 98]


def test_tool_tags_are_single_ids_that_decoding_keeps(saved):
    _, tokenizer = saved
    text = '<tool_call>\n{"name": "calc_x", "arguments": {"a": [1]}}\n</tool_call>'
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 95 and ids[-1] == 96 and len(ids) == len(text) - len("<tool_call></tool_call>") + 2
    assert 3 not in ids  # no <|unk|>: JSON tool calls fit the alphabet
    response = tokenizer("<tool_response>\n7\n</tool_response>", add_special_tokens=False)["input_ids"]
    assert (response[0], response[-1], len(response)) == (97, 98, 5)
    # Not special (as in Qwen): skip_special_tokens drops <|im_end|> but writes the tags back.
    assert tokenizer.decode([4, *ids, 5], skip_special_tokens=True) == text
    assert tokenizer.decode(ids) == text


def test_eos_terminated_response_decodes_to_the_answer(saved):
    _, tokenizer = saved
    response = tokenizer("19", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(response, skip_special_tokens=True) == "19"


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("response_format", ["plain", "boxed"])
def test_every_task_is_inside_the_alphabet(task, response_format):
    generator = make_task(task=task, response_format=response_format, symbols="xyz")
    for record in generator.generate(50, seed=0, split="train"):
        assert set(record["prompt"] + record["target"]) <= set(ALPHABET)


def test_chat_template_survives_saving(saved):
    _, tokenizer = saved
    text = tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|bos|><|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"


def test_build_is_deterministic_and_alphabet_checked(tmp_path):
    first = build_char_tokenizer()
    assert first.get_vocab() == build_char_tokenizer().get_vocab()
    assert build_char_tokenizer("01").get_vocab()["1"] == len(SPECIAL_TOKENS) + 1
    with pytest.raises(ConfigError, match="repeated: \\['1'\\]"):
        build_char_tokenizer("011")
