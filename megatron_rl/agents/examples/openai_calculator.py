"""An agent written as a plain OpenAI-client loop, trained unchanged through the rollout's
chat-completions endpoint (agents/openai_agent.py):

    rollout:
      agent: megatron_rl.agents.examples.openai_calculator:solve
      tools: [calculator]        # with an agent: only the tools the warm start's demonstrations show

It solves the built-in agentic task (configs/tiny_agent.yaml: multiply two 3-digit numbers) by
offering a calculator to the model and running the calls it makes, as any tool-calling agent
does; nothing in it knows it is being trained. It returns None, so the run's reward functions
(`rewards.terms`: the synthetic task's exact check) score the content of its last completion.
Point `base_url` at any OpenAI-compatible server and it runs the same way.
"""

from __future__ import annotations

import json

from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from megatron_rl.agents.calculator import CalculatorError, calculator

# The tool as the agent offers it (OpenAI's function-tool schema).
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly and return the result as an integer or a "
                       "fraction a/b.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {
                "type": "string",
                "description": "The expression, using numbers (integers or decimals), + - * / // % **, and "
                               "parentheses, e.g. \"(1/3 + 2**-1) * 6\"."}},
            "required": ["expression"],
        },
    },
}


def run_calculator(arguments: str) -> str:
    try:
        return calculator(json.loads(arguments)["expression"])
    except (CalculatorError, ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


async def solve(base_url: str, record: dict, max_rounds: int = 3) -> float | None:
    # The endpoint is plain HTTP on 127.0.0.1. A default client loads the CA bundle for TLS it will
    # never use: ~50 ms of CPU per client on 2 cores, seconds per step at 128 trajectories.
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                         http_client=DefaultAsyncHttpxClient(verify=False))
    messages = [{"role": "user", "content": record["prompt"]}]
    try:
        for _ in range(max_rounds):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return None  # its answer: scored by the run's reward functions
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": run_calculator(call.function.arguments)})
        return None
    finally:
        await client.close()
