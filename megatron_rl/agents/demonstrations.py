"""Multi-turn demonstrations for the supervised warm start (`megatron-rl sft`, `warm_start`).

A record's `demonstration` column holds the conversation after its prompt, in chat messages:

    [{"role": "assistant", "tool_calls": [{"name": "calculator", "arguments": {"expression": "123*456"}}]},
     {"role": "tool", "content": "56088"},
     {"role": "assistant", "content": "56088"}]

Tool calls are written in the model family's own format (agents/tool_parsers.py), and the whole
conversation becomes ids through the chat-format adapter's `conversation_ids`, the same path a
multi-turn rollout takes: the warm start trains on exactly the tokens RL later samples, with the
same mask (assistant turns and their end-of-turn token 1, the prompt and observations 0).
"""

from __future__ import annotations

from megatron_rl.agents.tool_parsers import format_tool_calls
from megatron_rl.data.chat import to_messages
from megatron_rl.errors import ConfigError


def demonstration_messages(demonstration: list[dict], tool_call_format: str, where: str) -> list[dict]:
    """The demonstration with every assistant's structured tool calls written into its content."""
    if not isinstance(demonstration, list) or not demonstration:
        raise ConfigError(f"{where}: a demonstration must be a non-empty list of chat messages")
    messages = []
    for index, message in enumerate(demonstration):
        if not isinstance(message, dict) or message.get("role") not in ("assistant", "tool", "user"):
            raise ConfigError(f"{where}[{index}]: each message needs role assistant, tool or user; got {message!r}")
        content = message.get("content") or ""
        calls = message.get("tool_calls") or []
        for call in calls:
            if not isinstance(call, dict) or "name" not in call:
                raise ConfigError(f"{where}[{index}].tool_calls: each call needs a name and arguments; got {call!r}")
        if calls:
            # joined as the family's template joins several calls in one turn
            content += format_tool_calls([(c["name"], c.get("arguments") or {}) for c in calls], tool_call_format)
        messages.append({"role": message["role"], "content": content})
    if messages[0]["role"] != "assistant":
        raise ConfigError(f"{where}: a demonstration starts with the assistant's first turn")
    return messages


def demonstration_ids(chat, record, *, system_prompt: str | None, tools: list[dict] | None,
                      where: str = "demonstration") -> tuple[list[int], list[int]]:
    """(ids, mask) of the record's prompt and demonstration, as a rollout would produce them."""
    messages = to_messages(record.prompt, system_prompt)
    messages += demonstration_messages(record.metadata["demonstration"], chat.tool_call_format, where)
    return chat.conversation_ids(messages, tools=tools)
