"""Prompt rendering: raw text, chat templates, and the errors when the two do not fit."""

from __future__ import annotations

import pytest

from megatron_rl.errors import ConfigError
from megatron_rl.data.chat import encode_prompt, render_prompt
from megatron_rl.data.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def no_template():
    return build_char_tokenizer(chat_template=None)


def test_raw_prompt_gets_the_tokenizers_bos(tokenizer):
    assert render_prompt(tokenizer, "12+7=") == "12+7="
    ids = encode_prompt(tokenizer, "12+7=")
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids[1:]) == "12+7="


def test_chat_prompt_uses_the_template_without_a_second_bos(tokenizer):
    text = render_prompt(tokenizer, "1+2=", prompt_format="chat", system_prompt="be brief")
    assert text == ("<|bos|><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = encode_prompt(tokenizer, "1+2=", prompt_format="chat")
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[-1] == tokenizer.convert_tokens_to_ids("\n")
    messages = ({"role": "user", "content": "1+2="},)
    assert encode_prompt(tokenizer, messages, prompt_format="chat") == ids


def test_chat_without_template_is_an_error(no_template):
    with pytest.raises(ConfigError, match="prompt_format='chat' but the tokenizer .* has no chat template"):
        encode_prompt(no_template, "1+2=", prompt_format="chat")


def test_raw_format_errors(tokenizer):
    with pytest.raises(ConfigError, match="needs text prompts"):
        render_prompt(tokenizer, ({"role": "user", "content": "hi"},))
    with pytest.raises(ConfigError, match="system_prompt needs prompt_format='chat'"):
        render_prompt(tokenizer, "hi", system_prompt="x")
    with pytest.raises(ConfigError, match="must be 'raw' or 'chat'"):
        render_prompt(tokenizer, "hi", prompt_format="plain")
    with pytest.raises(ConfigError, match="already starts with a system message"):
        render_prompt(tokenizer, ({"role": "system", "content": "a"}, {"role": "user", "content": "b"}),
                      prompt_format="chat", system_prompt="c")
