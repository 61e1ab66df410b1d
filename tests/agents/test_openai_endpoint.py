"""The OpenAI-compatible endpoint (agents/openai_agent.py, openai_server.py) with real OpenAI-client
agents against a scripted engine (mock: the engine only has to return given token ids; the real
vLLM engine and Megatron trainer run in test_openai_agent_training.py).

The scripted engine answers a prompt with a calculator call until the prompt holds a tool result,
then with the product; every request it saw is kept."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="the OpenAI client comes with vLLM (pip install -e .[rollout-cpu])")

from openai import AsyncOpenAI, BadRequestError  # noqa: E402

from megatron_rl.agents.chat_format import ChatFormat  # noqa: E402
from megatron_rl.agents.examples.openai_calculator import CALCULATOR, solve  # noqa: E402
from megatron_rl.agents.openai_agent import OpenAIAgentRollout, load_agent  # noqa: E402
from megatron_rl.agents.rollout import AgentRollout, AgentSettings  # noqa: E402
from megatron_rl.agents.tool_env import ToolEnvironment  # noqa: E402
from megatron_rl.agents.tool_parsers import format_tool_calls  # noqa: E402
from megatron_rl.agents.tools import ToolRegistry  # noqa: E402
from megatron_rl.data import build_char_tokenizer  # noqa: E402
from megatron_rl.data.chat import to_messages  # noqa: E402
from megatron_rl.data.records import PromptRecord  # noqa: E402
from megatron_rl.errors import ConfigError  # noqa: E402
from megatron_rl.rollout.protocol import Sample, SamplingParams  # noqa: E402
from megatron_rl.train.experience import expand_segments, group_advantages  # noqa: E402
from megatron_rl.train.scoring import to_trajectories  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import openai_test_agents  # noqa: E402

TOKENIZER = build_char_tokenizer()
CHAT = ChatFormat.for_tokenizer(TOKENIZER)
IM_END = TOKENIZER.convert_tokens_to_ids("<|im_end|>")
RECORDS = [PromptRecord("12*3=", "36"), PromptRecord("25*4=", "100")]


class ScriptedEngine:
    def __init__(self):
        self.requests = []

    def __call__(self, prompts, params: SamplingParams):
        self.requests.append((prompts, params))
        groups = []
        for index, prompt in enumerate(prompts):
            text = TOKENIZER.decode(prompt)
            question = text.split("<|im_start|>user\n")[-1].split("=")[0]
            if "<|im_start|>tool" in text or "calculator:" in text:
                reply = text.split("<|im_start|>tool\n")[-1].split("<|im_end|>")[0] if "<|im_start|>tool" in text \
                    else text.split("calculator: ")[-1].split("<|im_end|>")[0]
            else:
                reply = format_tool_calls([("calculator", {"expression": question})], "hermes")
            ids = TOKENIZER(reply, add_special_tokens=False)["input_ids"][:params.max_tokens_of(index) - 1] + [IM_END]
            logprobs = [-0.01 * (k + 1) for k in range(len(ids))]
            groups.append([Sample(index, 0, list(prompt), ids, logprobs, "stop")])
        return groups


def openai_rollout(agent, *, max_turns=3, max_total=400, timeout=10.0, window=0.05, **agent_args):
    return OpenAIAgentRollout(agent=agent, agent_args=agent_args, chat_format=CHAT, tokenizer=TOKENIZER,
                              settings=AgentSettings(max_turns, max_total, 2048, "last", timeout),
                              batch_window_s=window)


def run(agent, records=RECORDS, n=2, **settings):
    rollout = openai_rollout(agent, **settings)
    engine = ScriptedEngine()
    try:
        groups = rollout.run(records, SamplingParams(n=n, max_tokens=100, seed=7), engine)
    finally:
        rollout.close()
    return groups, engine


def test_calculator_agent_trains_on_the_same_tokens_as_the_environment_loop():
    """An OpenAI-client agent (call, run the tool, answer) yields exactly the sequence the
    environment loop builds for the same conversation: prompt, sampled ids (mask 1), the tool
    result rendered once (mask 0), the answer; the engine's logprobs on the model's tokens."""
    groups, engine = run(solve, window=5.0)  # a batch waits for all four agents, however slow the machine
    registry = ToolRegistry.from_paths(["calculator"])
    reference = AgentRollout(
        environment=lambda: ToolEnvironment(registry, CHAT.tool_call_format), chat_format=CHAT, tokenizer=TOKENIZER,
        settings=AgentSettings(3, 400, 2048, "last", 10.0),
        encode_record=lambda record, messages: CHAT.prompt_ids(to_messages(record.prompt), tools=registry.schemas()))
    try:
        expected = reference.run(RECORDS, SamplingParams(n=2, max_tokens=100, seed=7), ScriptedEngine())
    finally:
        reference.close()
    for ours, theirs in zip(groups, expected):
        for sample, other in zip(ours, theirs):
            assert sample.prompt_token_ids == other.prompt_token_ids
            assert sample.response_token_ids == other.response_token_ids
            assert sample.extras["loss_mask"] == other.extras["loss_mask"]
            assert sample.logprobs == other.logprobs
            assert sample.extras["segments"] == [] and sample.extras["agent"]["info"]["new_segments"] == 0
            assert sample.extras["agent"]["finish"] == "stop" and sample.extras["agent"]["turns"] == 2
            calls = sample.extras["agent"]["calls"]
            # each call's prompt is the previous call's prompt + its sampled ids + the observation
            assert calls[1]["prompt_tokens"] > calls[0]["prompt_tokens"] + calls[0]["sampled_tokens"]
            assert sample.extras["final_response_ids"] == other.extras["final_response_ids"]  # what rewards score
    # two engine requests (a batch per round: all four agents waited), per-call seeds distinct
    assert len(engine.requests) == 2 and all(len(prompts) == 4 for prompts, _ in engine.requests)
    assert len(set(engine.requests[0][1].prompt_seeds)) == 4


def test_rewritten_history_starts_a_new_segment_that_is_counted_and_trained():
    groups, engine = run(openai_test_agents.rewrites_history)
    for group in groups:
        for sample in group:
            (first,) = sample.extras["segments"]
            assert sample.extras["agent"]["info"]["new_segments"] == 1
            # the first segment: the first call's prompt and sampled call, nothing appended
            assert first.prompt_token_ids in [prompt for prompts, _ in engine.requests for prompt in prompts]
            assert first.extras["loss_mask"] == [1] * len(first.response_token_ids)
            # the last: the summarized history rendered whole, its own prompt (no stale tokens before it)
            prompt = TOKENIZER.decode(sample.prompt_token_ids)
            assert "calculator: " in prompt and "<tool_call>" not in prompt.split("<|im_start|>user")[-1]
            assert sample.prompt_token_ids == CHAT.prompt_ids(
                [{"role": "user", "content": TOKENIZER.decode(sample.prompt_token_ids).split(
                    "<|im_start|>user\n")[-1].split("<|im_end|>")[0]}], tools=[CALCULATOR])
    # both segments train, each with the trajectory's advantage
    from megatron_rl.algorithms.from_config import recipe_for
    from megatron_rl.config.rl import RLConfig

    trajectories = to_trajectories(groups, [1.0, 0.0, 1.0, 1.0])
    group_advantages(trajectories, recipe_for(RLConfig(recipe="grpo"), 100))
    advantages = [t.advantage for t in trajectories[0]]
    expand_segments(trajectories)
    assert len(trajectories[0]) == 4 and [t.advantage for t in trajectories[0][2:]] == advantages
    assert trajectories[0][2].reward == 1.0 and trajectories[0][3].reward == 0.0


def test_a_reformatted_but_equal_history_still_extends():
    """The client re-serializes the tool call's arguments (spacing) and adds keys of its own: the
    history is the same conversation, so the call appends (no false new segment)."""
    async def agent(base_url, record):
        client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
        messages = [{"role": "user", "content": record["prompt"]}]
        reply = (await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
                 ).choices[0].message.model_dump(exclude_none=True)
        for call in reply["tool_calls"]:
            call["function"]["arguments"] = json.dumps(json.loads(call["function"]["arguments"]), indent=2)
        messages += [dict(reply, refusal=None), {"role": "tool", "tool_call_id": "x", "content": "36"}]
        await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        await client.close()
        return 1.0

    groups, _ = run(agent, records=RECORDS[:1], n=1)
    (sample,), = groups
    assert sample.extras["segments"] == [] and sample.extras["agent"]["reward"] == 1.0
    assert sample.extras["loss_mask"].count(0) > 0  # the tool result, appended as an observation


def test_failures_end_their_trajectory_and_are_reported_to_the_agent():
    async def raises(base_url, record):
        client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1*1="}])
        raise RuntimeError("agent bug")

    async def never_calls(base_url, record):
        return 1.0

    async def stalls(base_url, record):
        client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1*1="}])
        await asyncio.sleep(3)
        return 1.0

    for agent, error in ((raises, "agent bug"), (never_calls, "without calling"), (stalls, "env_timeout_s")):
        started = time.monotonic()
        groups, _ = run(agent, records=RECORDS[:1], n=1, timeout=1.0)
        (sample,), = groups
        assert sample.extras["agent"]["status"] == "failed" and error in sample.extras["agent"]["error"]
        assert time.monotonic() - started < 2.9  # the stalled agent was not waited for
        if agent is raises:  # where the agent raised: what a stop for all of them failing names
            assert sample.extras["agent"]["error"].endswith(f"(at {__file__}:{raises.__code__.co_firstlineno + 3})")
    groups, _ = run(openai_test_agents.asks_for_too_much, records=RECORDS[:1], n=1, max_turns=3)
    (sample,), = groups
    agent = sample.extras["agent"]
    assert agent["finish"] == "max_turns" and agent["turns"] == 3 and agent["reward"] == 1.0  # it saw the 400
    assert sample.finish_reason == "length"  # a truncation (rl.mask_truncated)
    groups, _ = run(openai_test_agents.asks_for_too_much, records=RECORDS[:1], n=1, max_turns=10, max_total=150)
    assert groups[0][0].extras["agent"]["finish"] == "length"


def test_requests_the_recorder_cannot_honour_are_refused_with_400():
    async def agent(base_url, record):
        client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
        refused = []
        for extra in ({"n": 2}, {"stream": True}, {"messages": []}):
            try:
                await client.chat.completions.create(**{"model": "policy", "messages": [
                    {"role": "user", "content": "1*1="}], **extra})
            except BadRequestError as exc:
                refused.append(exc.status_code)
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1*1="}])
        await client.close()
        return float(refused == [400, 400, 400])

    groups, _ = run(agent, records=RECORDS[:1], n=1)
    assert groups[0][0].extras["agent"]["reward"] == 1.0


def test_agent_paths_are_checked_at_start_up():
    with pytest.raises(ConfigError, match="cannot import 'no_such_pkg.agents'"):
        load_agent("no_such_pkg.agents:solve", {})
    with pytest.raises(ConfigError, match="must take \\(base_url, record"):
        load_agent("megatron_rl.agents.examples.openai_calculator:solve", {"temperature": 0.5})
    with pytest.raises(ConfigError, match="has no 'nope'"):
        load_agent("megatron_rl.agents.examples.openai_calculator:nope", {})
    from megatron_rl.config.rollout import RolloutConfig

    with pytest.raises(ConfigError, match="not both"):
        RolloutConfig(agent="a.b:c", environment="a.b:D").validate("rollout")
    with pytest.raises(ConfigError, match="agent_args is set"):
        RolloutConfig(agent_args={"k": 1}).validate("rollout")


def test_groups_run_concurrently_share_one_endpoint_and_keep_their_own_seeds():
    """The asynchronous producer runs each group in its own thread (one run() call per group,
    each with its own seed offset), all served by one endpoint: every group gets its own
    trajectories, and each call keeps the seed it has when the groups run one after another."""
    from concurrent.futures import ThreadPoolExecutor

    rollout = openai_rollout(solve)
    params = SamplingParams(n=2, max_tokens=100, seed=7)
    engines = [ScriptedEngine() for _ in RECORDS]
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(rollout.run, [record], params.offset(index), engine)
                       for index, (record, engine) in enumerate(zip(RECORDS, engines))]
            concurrent = [future.result()[0] for future in futures]
        sequential = ScriptedEngine()
        alone = rollout.run(RECORDS, params, sequential)
    finally:
        rollout.close()
    for group, reference in zip(concurrent, alone):
        for sample, other in zip(group, reference):
            assert sample.prompt_token_ids + sample.response_token_ids == \
                other.prompt_token_ids + other.response_token_ids
    seeds_concurrent = sorted(s for engine in engines for _, p in engine.requests for s in p.prompt_seeds)
    assert len(set(seeds_concurrent)) == 8
    assert seeds_concurrent == sorted(s for _, p in sequential.requests for s in p.prompt_seeds)


def test_a_slow_agent_does_not_hold_the_others_batch():
    """Agents start together: their first calls are one batch. After that an agent busy between
    calls (here 1.5 s in its tool) is not waited for: once calls stop arriving for the batch
    window, the others' calls go to the engine."""
    async def slow_tool_agent(base_url, record):
        client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
        messages = [{"role": "user", "content": record["prompt"]}]
        reply = (await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
                 ).choices[0].message
        if record["answer"] == "100":
            await asyncio.sleep(1.5)  # a slow tool
        messages += [reply.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": record["answer"]}]
        await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        await client.close()

    rollout = openai_rollout(slow_tool_agent, window=0.5)
    engine = ScriptedEngine()
    sent = []
    try:
        def timed(prompts, params):
            sent.append((time.monotonic(), len(prompts)))
            return engine(prompts, params)

        groups = rollout.run(RECORDS, SamplingParams(n=2, max_tokens=100, seed=7), timed)
    finally:
        rollout.close()
    assert all(sample.extras["agent"]["finish"] == "stop" and sample.extras["agent"]["turns"] == 2
               for group in groups for sample in group)
    assert [size for _, size in sent] == [4, 2, 2]  # all first calls; the fast second calls; the slow ones
    assert sent[1][0] - sent[0][0] < 1.4  # the fast agents' calls did not wait for the slow tool


def test_no_trajectory_can_reach_another_through_a_url_derived_from_its_own():
    """Each trajectory's URL carries its own random token: an agent that posts to the URLs it
    could derive from its own (the same token with another index at its end, as a prefix plus
    index would give, or one character changed) is answered 404, and every other trajectory
    records only its own agent's calls."""
    from openai import NotFoundError

    tokens, refused = [], []

    async def prober(base_url, record):
        client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
        messages = [{"role": "user", "content": record["prompt"]}]
        reply = (await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
                 ).choices[0].message
        token = base_url.split("/t/")[1].split("/v1")[0]
        tokens.append(token)
        neighbours = [token[:-8] + f"{index:08x}" for index in range(8)]
        neighbours.append(token[:-1] + ("B" if token[-1] == "A" else "A"))
        for url in (base_url.replace(token, other) for other in neighbours if other != token):
            other = AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
            try:
                await other.chat.completions.create(model="policy", messages=messages)
                refused.append(None)
            except NotFoundError as exc:
                refused.append(exc.status_code)
            except Exception as exc:  # noqa: BLE001 - anything but a 404 reached a trajectory
                refused.append(type(exc).__name__)
            finally:
                await other.close()
        messages += [reply.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": record["answer"]}]
        await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        await client.close()
        return 1.0

    groups, engine = run(prober, window=5.0)
    assert refused and set(refused) == {404}, refused
    for sample in (sample for group in groups for sample in group):
        agent = sample.extras["agent"]
        assert agent["finish"] == "stop" and agent["turns"] == 2 and agent["reward"] == 1.0, agent
    assert len(engine.requests) == 2 and all(len(prompts) == 4 for prompts, _ in engine.requests)
    # a token of its own per trajectory, of at least 128 random bits (base64url: 6 bits a character),
    # sharing no prefix with another's that would tell one from another
    assert len(set(tokens)) == len(tokens) == 4 and all(len(token) * 6 >= 128 for token in tokens)
    assert len({token[:8] for token in tokens}) == 4


def test_requests_nested_too_deep_are_refused_with_400_and_the_trajectory_goes_on():
    """A body of 100,000 nested arrays (Python's JSON parser raised RecursionError: a 500), one
    nested 150 levels (parsed, deeper than any request, MAX_NESTING), and tool-call arguments
    that nest 100,000 levels inside their JSON text: each is a 400, and the agent's next call is
    served as usual."""
    import urllib.error
    import urllib.request

    from megatron_rl.agents.openai_server import MAX_NESTING

    deep = "[" * 100_000 + "]" * 100_000
    user = {"role": "user", "content": "1*1="}
    call = {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": deep}}
    bodies = [
        '{"model": "policy", "messages": ' + deep + "}",
        json.dumps({"model": "policy", "messages": [user], "metadata": json.loads("[" * 150 + "]" * 150)}),
        json.dumps({"model": "policy", "messages": [user, {"role": "assistant", "content": None,
                                                           "tool_calls": [call]}]}),
    ]
    answers = []

    def post(url: str, body: str) -> tuple[int, str]:
        request = urllib.request.Request(url, data=body.encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    async def agent(base_url, record):
        for body in bodies:
            answers.append(await asyncio.to_thread(post, f"{base_url}/chat/completions", body))
        client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
        await client.chat.completions.create(model="policy", messages=[user])
        await client.close()
        return 1.0

    groups, _ = run(agent, records=RECORDS[:1], n=1)
    assert [status for status, _ in answers] == [400, 400, 400], answers
    assert all(f"nested more than {MAX_NESTING} levels deep" in text for _, text in answers), answers
    assert groups[0][0].extras["agent"]["status"] != "failed" and groups[0][0].extras["agent"]["reward"] == 1.0
