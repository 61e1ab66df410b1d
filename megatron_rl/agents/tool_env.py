"""The built-in tool environment: the model calls tools until it answers without a call.

Used when `rollout.tools` is set without `rollout.environment`: each model turn is parsed for
tool calls in its chat template's format (agents/tool_parsers.py); every call is run through the
registry and its result (or the error the model should see: unknown tool, bad arguments, a
malformed call) becomes a `tool` message of the next observation. A turn without a call is the
answer: the trajectory ends and the run's reward functions score that last turn.

Subclass it to add turn rewards or a different stopping rule; `run_tool_calls` is the part
worth keeping.
"""

from __future__ import annotations

from megatron_rl.agents.environment import Environment, Observation
from megatron_rl.agents.tool_parsers import parse_tool_calls
from megatron_rl.agents.tools import ToolError, ToolRegistry


class ToolEnvironment(Environment):
    def __init__(self, registry: ToolRegistry, tool_call_format: str):
        self.registry, self.tool_call_format = registry, tool_call_format

    def reset(self, record) -> Observation:
        return Observation()  # the record's prompt, with the tools in its system prompt

    def step(self, response_text: str, response_ids: list[int]) -> Observation:
        messages, info = self.run_tool_calls(response_text)
        if not messages:
            return Observation(done=True, info=info)
        return Observation(messages=messages, info=info)

    def run_tool_calls(self, response_text: str) -> tuple[list[dict], dict[str, float]]:
        """The tool messages answering the calls in `response_text` (empty: it made none) and the
        counts `tool_calls`, `tool_errors` (calls that ran into an error) and `malformed_calls`."""
        calls, malformed = parse_tool_calls(response_text, self.tool_call_format, self.registry.schemas())
        messages, errors = [], 0
        for call in calls:
            try:
                result = self.registry.call(call)
            except ToolError as exc:
                result, errors = str(exc), errors + 1
            messages.append({"role": "tool", "content": result})
        for problem in malformed:
            messages.append({"role": "tool", "content": f"error: malformed tool call: {problem}"})
        return messages, {"tool_calls": float(len(calls) + len(malformed)), "tool_errors": float(errors + len(malformed)),
                          "malformed_calls": float(len(malformed))}
