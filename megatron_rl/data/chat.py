"""Turn a prompt record into the text and token ids the model is given.

Two formats (``DataConfig.prompt_format``):

* "raw": the prompt text as it is, tokenized with the tokenizer's special tokens (its BOS, if
  its post-processor adds one). Chat-message prompts are refused: there is no text to use.
* "chat": the tokenizer's chat template with the generation prompt appended
  (``apply_chat_template(..., add_generation_prompt=True)``), tokenized *without* adding special
  tokens again, because templates write their own (a second BOS would change the model's input).
  A text prompt becomes one user message, after the optional system prompt. A tokenizer without a
  chat template is a ConfigError, not a silent fall-back to raw: the model would see a different
  input from the one the recipe describes.

Give the rollout engine the token ids from ``encode_prompt`` rather than text, so the engine and
the trainer cannot tokenize differently.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from megatron_rl.errors import ConfigError

__all__ = ["render_prompt", "encode_prompt", "to_messages"]


def to_messages(prompt: str | Sequence[Mapping[str, str]], system_prompt: str | None = None) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt is not None:
        if messages and messages[0].get("role") == "system":
            raise ConfigError("data.system_prompt is set but the prompt already starts with a system message")
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def render_prompt(tokenizer, prompt: str | Sequence[Mapping[str, str]], *, prompt_format: str = "raw",
                  system_prompt: str | None = None) -> str:
    """The prompt as text, before tokenization (special tokens of the template included)."""
    if prompt_format == "raw":
        if not isinstance(prompt, str):
            raise ConfigError(
                "data.prompt_format='raw' needs text prompts, but this record holds chat messages; "
                "use prompt_format='chat'"
            )
        if system_prompt is not None:
            raise ConfigError("data.system_prompt needs prompt_format='chat'")
        return prompt
    if prompt_format != "chat":
        raise ConfigError(f"data.prompt_format must be 'raw' or 'chat', got {prompt_format!r}")
    if getattr(tokenizer, "chat_template", None) is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ConfigError(
            f"data.prompt_format='chat' but the tokenizer {name!r} has no chat template; "
            "use prompt_format='raw' or a tokenizer that ships one"
        )
    from megatron_rl.data.chat_template import render_chat_template

    # apply_chat_template's text, rendered with bounds on size and time: the template is the model's code
    return render_chat_template(tokenizer, to_messages(prompt, system_prompt), add_generation_prompt=True)


def encode_prompt(tokenizer, prompt: str | Sequence[Mapping[str, str]], *, prompt_format: str = "raw",
                  system_prompt: str | None = None) -> list[int]:
    """Token ids of the prompt as the model should see it (see the module docstring)."""
    text = render_prompt(tokenizer, prompt, prompt_format=prompt_format, system_prompt=system_prompt)
    ids = tokenizer(text, add_special_tokens=prompt_format == "raw")["input_ids"]
    return list(ids)
