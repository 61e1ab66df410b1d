"""Agents the endpoint tests run (imported by path, `rollout.agent: openai_test_agents:<name>`,
with tests/agents on PYTHONPATH). Each is a plain OpenAI-client program."""

from __future__ import annotations

from openai import AsyncOpenAI, BadRequestError

from megatron_rl.agents.examples.openai_calculator import CALCULATOR, run_calculator


async def rewrites_history(base_url: str, record: dict) -> float | None:
    """The calculator agent, except that after the tool call it starts over with a summarized
    history (a user message stating the tool's result), as context-managing agents do: the
    second call does not extend the first one's tokens, so it must open a new segment."""
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    try:
        question = [{"role": "user", "content": record["prompt"]}]
        first = (await client.chat.completions.create(model="policy", messages=question,
                                                      tools=[CALCULATOR])).choices[0].message
        if not first.tool_calls:
            return None
        result = run_calculator(first.tool_calls[0].function.arguments)
        summary = [{"role": "user", "content": f"{record['prompt']} calculator: {result}"}]
        await client.chat.completions.create(model="policy", messages=summary, tools=[CALCULATOR])
        return None
    finally:
        await client.close()


async def extends_then_rewrites(base_url: str, record: dict) -> float | None:
    """Needs no trained model: a first call, a second that extends it with a user message (an
    observation in the same sequence), and, for every other prompt (by its last digit), a third
    with a rewritten history (a new segment). Short calls (max_tokens) keep the budget."""
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    try:
        messages = [{"role": "user", "content": record["prompt"]}]
        first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        await client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
        if int(record["prompt"].rstrip("=")[-1]) % 2:
            await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": record["prompt"] + " retry"}], max_tokens=16)
        return None
    finally:
        await client.close()


async def asks_for_too_much(base_url: str, record: dict) -> float | None:
    """Calls until the endpoint refuses (rollout.max_turns); returns 1 if it was refused with 400."""
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    try:
        messages = [{"role": "user", "content": record["prompt"]}]
        for _ in range(20):
            reply = await client.chat.completions.create(model="policy", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "again"}]
    except BadRequestError:
        return 1.0
    finally:
        await client.close()
    return 0.0
