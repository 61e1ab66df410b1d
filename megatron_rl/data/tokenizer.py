"""A tiny character-level tokenizer for the synthetic tasks, built locally (no download).

One token per character of ``ALPHABET`` (digits, arithmetic and punctuation, space, newline,
``\\ { }`` for boxed answers, lowercase letters, then ``" _ [ ]``, capitals, ``' #`` for JSON tool
calls and tool descriptions: everything the synthetic prompts, answers, tool calls and the chat
template use) plus special tokens and the Hermes tool-call tags. Ids are fixed by the order below, so a checkpoint trained with this
tokenizer stays valid for any later build of it (characters and tags are only ever appended):

    0 <|pad|>   1 <|bos|>   2 <|eos|>   3 <|unk|>   4 <|im_start|>   5 <|im_end|>
    6..94 ALPHABET (6..62 the first 57 characters; appended later: 63..66 ``" _ [ ]``,
          67..92 ``A..Z``, 93 ``'``, 94 ``#``)
    95 <tool_call>   96 </tool_call>   97 <tool_response>   98 </tool_response>

99 tokens in all (models pad their embedding to a larger multiple anyway; the presets use 512).
The four tags are single added tokens that are *not* special, as in Qwen's vocabulary: encoding
"<tool_call>" gives one id, and decoding writes the tag back even with
``skip_special_tokens=True`` (a tool-call parser reads the decoded text).

Encoding adds ``<|bos|>`` in front (the post-processor does it, so vLLM and transformers agree);
decoding concatenates characters (no spaces added, no clean-up of spaces around punctuation).
A small ChatML-style template is included for ``prompt_format="chat"``; the tiny default uses
raw prompts, which are shorter.

``save_tokenizer`` writes a directory that ``transformers.AutoTokenizer.from_pretrained`` (hence
vLLM) loads as a fast tokenizer, with transformers 4.x or 5.x.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_rl.errors import ConfigError

__all__ = [
    "ALPHABET", "SPECIAL_TOKENS", "TOOL_TOKENS", "CHAT_TEMPLATE", "build_char_tokenizer", "save_tokenizer",
    "write_char_tokenizer",
]

PAD, BOS, EOS, UNK = "<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, IM_START, IM_END)

# Append only: a character's id is its position, and checkpoints depend on the ids.
ALPHABET = ("0123456789" + "+-*/%=()<>,.:;?! \n" + "\\{}" + "abcdefghijklmnopqrstuvwxyz" + '"_[]'
            + "ABCDEFGHIJKLMNOPQRSTUVWXYZ'#")

# Hermes tool-call tags (Qwen2.5 / Qwen3 write tool calls and results with them), one id each after
# the alphabet; added tokens that are not special, so decoding never drops them.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# The template before it took tools (tokenizers saved with earlier checkpoints carry it).
PLAIN_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# ChatML layout (as Qwen's); role names are lowercase so they stay inside the alphabet. Tools
# (`apply_chat_template(..., tools=[...])`) go into the system turn as one JSON schema per line
# after a short instruction: Qwen's Hermes block says the same in 600 characters, which a
# character-level tiny model would read at every step.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n' }}{% endif %}"
    "{{ 'tools, called as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>:' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_char_tokenizer(alphabet: str = ALPHABET, *, chat_template: str | None = CHAT_TEMPLATE,
                         model_max_length: int = 1024):
    """A ``transformers.PreTrainedTokenizerFast`` with one token per character of ``alphabet``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if not alphabet or len(set(alphabet)) != len(alphabet):
        duplicates = sorted({c for c in alphabet if alphabet.count(c) > 1})
        raise ConfigError(f"tokenizer alphabet must be non-empty characters without repeats; repeated: {duplicates!r}")
    vocab = {token: index for index, token in enumerate((*SPECIAL_TOKENS, *alphabet, *TOOL_TOKENS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own pre-token ([\s\S] also matches newlines, unlike ".").
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    core.add_special_tokens(list(SPECIAL_TOKENS))
    # Already in the vocabulary, so they keep the ids above; as added tokens they are matched whole
    # before the character split.
    core.add_tokens([AddedToken(token, special=False, normalized=False) for token in TOOL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=chat_template,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        padding_side="right",
    )


def save_tokenizer(tokenizer, directory: str | Path) -> Path:
    """``save_pretrained`` plus what older loaders need; returns the directory.

    transformers 5 records its class as "TokenizersBackend", a name transformers 4 (which some
    vLLM versions pin) does not know; "PreTrainedTokenizerFast" loads in both. Likewise for the
    extra special tokens' key. The chat template is also written into tokenizer_config.json,
    where loaders older than chat_template.jinja look. Checked with transformers 4.57 and 5.x.
    """
    directory = Path(directory)
    tokenizer.save_pretrained(directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    # transformers 5 writes extra special tokens as a list under "extra_special_tokens", which
    # transformers 4 reads as a dict of named tokens (and fails); both read this older key.
    extra = config.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        config["additional_special_tokens"] = extra
    config["clean_up_tokenization_spaces"] = False
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return directory


def write_char_tokenizer(directory: str | Path, alphabet: str = ALPHABET, **kwargs) -> Path:
    """Build the character tokenizer and save it (e.g. into a model directory for vLLM)."""
    return save_tokenizer(build_char_tokenizer(alphabet, **kwargs), directory)
