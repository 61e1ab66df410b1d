"""OpenAI chat messages <-> what the chat template and the trainer see (agents/openai_agent.py).

- `request_messages`: a request's messages checked (roles, text or text parts), content as text.
- `normalized`: what makes two messages the same turn, so a history the client hands back (its
  own JSON spacing in tool-call arguments, extra keys) is recognised as the one the endpoint served.
- `template_messages`: messages as the chat template takes them; an assistant's structured tool
  calls written into its content in the model's own format (agents/tool_parsers.py).
- `reply_message`: a sampled turn's text as the assistant message the client gets (tool calls
  parsed out when the request offered tools); `completion`: the chat.completion object.
"""

from __future__ import annotations

import json
import time
from typing import Any, Sequence

from megatron_rl.agents.openai_server import EndpointError
from megatron_rl.agents.tool_parsers import (
    format_tool_calls,
    has_tool_call_start,
    parse_tool_calls,
    text_before_tool_calls,
)


def request_messages(messages: Any) -> list[dict]:
    """The request's messages, checked, each with its content as text."""
    if not isinstance(messages, list) or not messages:
        raise EndpointError(400, "messages must be a non-empty list")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer", "user",
                                                                         "assistant", "tool"):
            raise EndpointError(400, f"messages[{index}] must have a role system / user / assistant / tool")
        checked.append(dict(message, content=_text(message.get("content"), index)))
    return checked


def _text(content: Any, index: int) -> str:
    """A message's content as text (OpenAI allows a list of parts; only text parts are read)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        if any(part.get("type") != "text" for part in content):
            raise EndpointError(400, f"messages[{index}]: only text content parts are supported")
        return "".join(str(part.get("text", "")) for part in content)
    raise EndpointError(400, f"messages[{index}].content must be text or a list of text parts")


def _tool_calls(message: dict) -> list[tuple[str, Any]]:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise EndpointError(400, f"a tool call must be {{'type': 'function', 'function': {{...}}}}, got {call!r}")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                pass  # compared as written
        calls.append((function.get("name"), arguments))
    return calls


def normalized(message: dict) -> tuple:
    """What makes two messages the same turn: role, text, tool calls (arguments parsed, so the
    client's JSON spacing does not matter) and a tool result's name."""
    return (message["role"], message.get("content") or "", json.dumps(_tool_calls(message), sort_keys=True),
            message.get("name") or "")


def template_messages(messages: list[dict], tool_call_format: str | None) -> list[dict]:
    """Messages as the chat template takes them: {"role", "content"}; an assistant's structured
    tool calls written into its content in the model's own format (agents/tool_parsers.py)."""
    rendered = []
    for message in messages:
        role = "system" if message["role"] == "developer" else message["role"]
        content = message.get("content") or ""
        calls = _tool_calls(message) if role == "assistant" else []
        if calls:
            content = content + format_tool_calls(calls, tool_call_format)
        rendered.append({"role": role, "content": content})
    return rendered


def reply_message(text: str, tools: list | None, fmt: str, call_id: str) -> dict:
    """The assistant message for `text`: tool calls parsed out when the request offered tools
    (the content is what precedes the first call). `call_id` names the call (unique in the
    rollout), from which the tool calls' ids are made."""
    if not tools or not has_tool_call_start(text, fmt):
        return {"role": "assistant", "content": text}
    calls, _errors = parse_tool_calls(text, fmt, tools)
    if not calls:
        return {"role": "assistant", "content": text}  # malformed: the agent sees the text as written
    content = text_before_tool_calls(text, fmt).strip()
    return {"role": "assistant", "content": content or None,
            "tool_calls": [{"id": f"call_{call_id}_{index}", "type": "function",
                            "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
                           for index, call in enumerate(calls)]}


def completion(message: dict, finish: str, prompt_tokens: int, tokens: list[int], logprobs: Sequence[float],
               call_id: str) -> dict:
    """The OpenAI chat.completion object (plus the exact token ids and logprobs, as vLLM's
    `return_token_ids` adds them: an agent may log them; training does not depend on it)."""
    return {"id": f"chatcmpl-{call_id}", "object": "chat.completion", "created": int(time.time()),
            "model": "policy",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None,
                         "token_ids": tokens, "token_logprobs": [float(v) for v in logprobs]}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens),
                      "total_tokens": prompt_tokens + len(tokens)}}
