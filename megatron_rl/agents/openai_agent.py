"""Agents written against the OpenAI client, trained on the exact tokens the engine served them.

    rollout.agent: "my_pkg.agents:solve"      # async def solve(base_url, record, **agent_args) -> float | None
    rollout.agent_args: {max_steps: 4}

    async def solve(base_url, record, max_steps=4):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
        messages = [{"role": "user", "content": record["prompt"]}]
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        ...                                                    # the agent's own loop, unchanged
        return None                                            # or its own reward

Each of a record's G trajectories runs the agent once, in its own thread, with its own base URL
(a loopback chat-completions endpoint, agents/openai_server.py). The path carries the trajectory's
token, random and unguessable (`TOKEN_BYTES`, drawn per trajectory): an agent cannot reach another
trajectory through its own URL, and a token no running trajectory holds is answered 404.
`record` is {"prompt", "answer", "metadata"}. The agent returns its reward, or None to have the
run's reward functions (`rewards.terms`) score the content of its last completion.

What is recorded. Every call's prompt is rendered to ids by the model's chat template
(agents/chat_format.py, with the request's `tools`), sampled by the policy's engine, and
appended to the trajectory's record: prompt ids, sampled ids (mask 1), the engine's logprobs,
the tokens' policy versions (asynchronous RL) and MoE routes (R3). The agent gets the decoded
text, with tool calls parsed into `tool_calls` when the request offered tools.

How calls become one sequence. A call extends the trajectory when its history is the previous
call's messages, then the assistant message this endpoint returned (content and tool calls, as
the OpenAI client hands them back), then only new tool / user messages: those are rendered once
after the sampled ids (`observation_ids`, mask 0), exactly as a multi-turn environment's
observation, so the sampled ids are never decoded and re-encoded. Any other history (rewritten,
summarized, tools changed, an assistant message edited) is rendered whole; if those ids still
start with the trajectory's tokens the rest is appended as an observation, otherwise the call
starts a **new segment** (its own prompt), counted in `agent/info/new_segments`. A trajectory
trains on all its segments, each a sequence with the trajectory's advantage (the group compares
trajectories: one reward each); the last segment is the one the reward functions score.

Sampling is the run's: the policy's temperature, top_p and seeds (per trajectory and call,
independent of batching): training needs the tokens the policy samples, so a request's
`temperature`, `top_p`, `seed`, penalties, `stop` or `logprobs` are ignored;
its `max_tokens` / `max_completion_tokens` can only lower the per-call cap
(`rl.max_response_tokens`). `n` > 1 and `stream` are refused (400).

Budgets and failures, as for environments (agents/rollout.py): `rollout.max_turns` calls per
trajectory, `rollout.max_total_tokens` after a segment's prompt, `rollout.max_model_len` per
sequence. A call beyond a budget is answered 400 and ends the trajectory `max_turns` / `length`
(truncations, `rl.mask_truncated`); whatever the agent does after that is not recorded. An
agent that raises (other than after such a 400), makes no call, or spends longer than
`rollout.env_timeout_s` between calls ends `failed`, and its group is dropped from training.

Calls are batched: an engine request goes out when every running agent is waiting on a call, or
when no call has arrived for `BATCH_WINDOW_S` once every agent has made its first call (an agent
busy in a slow tool does not hold the others), with one prompt per call. In colocated runs every rank takes part in every engine
request (`share` broadcasts the driver's batch); agents, the endpoint and the records live on
the driver.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import json
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from megatron_rl.agents.environment import import_callable
from megatron_rl.agents.openai_messages import (
    completion,
    normalized,
    reply_message,
    request_messages,
    template_messages,
)
from megatron_rl.agents.openai_server import ChatCompletionsServer, EndpointError
from megatron_rl.agents.rollout import AgentSettings, Generate, turn_seed
from megatron_rl.agents.tool_parsers import has_tool_call_start
from megatron_rl.errors import ConfigError, raised_at
from megatron_rl.rollout.protocol import Sample, SamplingParams

BATCH_WINDOW_S = 0.5  # a batch goes out once no call has arrived for this long (or all agents wait)
TOKEN_BYTES = 32  # the random bytes of a trajectory's URL token (secrets.token_urlsafe: 43 characters)


@dataclass
class _Segment:
    """One training sequence of a trajectory: a prompt and everything appended after it."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] | None = None
    routes: Any = None
    last_turn: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.ids

    def append_observation(self, ids: list[int]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        if self.versions is not None:
            self.versions += [self.versions[-1] if self.versions else 0] * len(ids)


@dataclass
class _Call:
    """One chat-completions request waiting for its engine answer."""

    prompt_ids: list[int]
    max_tokens: int
    seed: int | None
    history: list  # the request's messages, normalized (openai_messages.normalized)
    tools: list | None
    new_segment: bool
    appended: list[int]  # observation ids to append to the current segment (extension only)
    done: threading.Event = field(default_factory=threading.Event)
    response: dict | None = None
    taken: bool = False


@dataclass
class _Run:
    group: int
    sample: int
    token: str  # its URL's secret (module docstring)
    record: dict
    params: SamplingParams  # the request's: its seeds and per-call cap
    segments: list[_Segment] = field(default_factory=list)
    history: list | None = None  # the messages the current segment's tokens stand for, last reply included
    tools_key: str | None = None
    calls: list[dict] = field(default_factory=list)  # per call: segment, prompt / sampled tokens, version
    new_segments: int = 0
    model_tokens: int = 0
    tool_calls: int = 0  # calls the endpoint parsed out of the model's text (and returned structured)
    malformed_calls: int = 0  # turns that started a call the parser could not read (returned as text)
    pending: _Call | None = None
    since: float = field(default_factory=time.monotonic)  # the agent's last sign of life
    finish: str | None = None  # None while running; stop | length | max_turns | failed
    reward: float | None = None
    error: str | None = None

    @property
    def running(self) -> bool:
        return self.finish is None


class OpenAIAgentRollout:
    def __init__(self, *, agent: Callable, agent_args: dict, chat_format, tokenizer, settings: AgentSettings,
                 batch_window_s: float = BATCH_WINDOW_S):
        self.agent, self.agent_args = agent, dict(agent_args)
        self.batch_window_s = batch_window_s
        self.chat, self.tokenizer, self.settings = chat_format, tokenizer, settings
        self.env_wall_s = 0.0  # seconds the driver waited on agents between engine requests, ever
        self._cond = threading.Condition()
        # every running trajectory by its URL token's digest (`_digest`; the asynchronous producer
        # runs several groups at once, each in its own run() call, all served by the one endpoint)
        self._runs: dict[bytes, _Run] = {}
        self._server: ChatCompletionsServer | None = None

    @classmethod
    def from_config(cls, config, tokenizer, chat_format) -> OpenAIAgentRollout:
        rollout = config.rollout
        settings = AgentSettings(rollout.max_turns, rollout.max_total_tokens, rollout.max_model_len,
                                 rollout.turn_reward, rollout.env_timeout_s)
        return cls(agent=load_agent(rollout.agent, rollout.agent_args), agent_args=rollout.agent_args,
                   chat_format=chat_format, tokenizer=tokenizer, settings=settings)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    # ---- the loop -----------------------------------------------------------------------------

    def run(self, records: Sequence[Any], params: SamplingParams, generate: Generate,
            share: Callable[[Any], Any] = lambda value: value, is_driver: bool = True) -> list[list[Sample]]:
        """G = params.n trajectories per record, as Samples grouped by record. Collective when
        `share` broadcasts from the driver (every rank calls it with the same arguments)."""
        runs: list[_Run] = []
        if is_driver:
            # a token of its own per trajectory: no agent can derive another trajectory's URL from its own
            runs = [_Run(group, sample, secrets.token_urlsafe(TOKEN_BYTES), _record_dict(records[group]), params)
                    for group in range(len(records)) for sample in range(params.n)]
            with self._cond:
                if self._server is None:
                    self._server = ChatCompletionsServer(self._on_call)
                self._runs.update({_digest(run.token): run for run in runs})
            threads = [threading.Thread(target=self._agent_thread, args=(run,), daemon=True,
                                        name=f"agent-{run.group}-{run.sample}") for run in runs]
            for thread in threads:
                thread.start()
        try:
            while True:
                batch = self._next_batch(runs) if is_driver else None
                request = share(None if batch is None else [(c.prompt_ids, c.max_tokens, c.seed) for c in batch])
                if request is None:
                    break
                sampling = replace(params, n=1, seed_offset=0,
                                   prompt_max_tokens=tuple(budget for _, budget, _ in request),
                                   prompt_seeds=tuple(seed for _, _, seed in request) if params.seed is not None else (),
                                   stop_token_ids=tuple(dict.fromkeys((*params.stop_token_ids,
                                                                       *self.chat.stop_token_ids))))
                groups = generate([prompt for prompt, _, _ in request], sampling)
                if is_driver:
                    self._deliver(batch, [group[0] for group in groups])
            if is_driver:
                # a trajectory a budget ended: its agent got a 400 and may still return a reward
                deadline = time.monotonic() + self.settings.env_timeout_s
                for thread in threads:
                    thread.join(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            if is_driver:
                with self._cond:
                    for run in runs:
                        self._runs.pop(_digest(run.token), None)
                        self._end(run, "failed", "the rollout stopped before the agent finished", final=True)
        groups = None
        if is_driver:
            groups = [[self._sample(run) for run in runs[group * params.n:(group + 1) * params.n]]
                      for group in range(len(records))]
        return share(groups)  # every rank trains on the driver's records

    def _agent_thread(self, run: _Run) -> None:
        base_url = self._server.base_url(run.token)
        try:
            result = asyncio.run(_awaited(self.agent(base_url, run.record, **self.agent_args)))
            error = None
        except BaseException as exc:  # noqa: BLE001 - any agent failure fails its trajectory only
            result, error = None, f"the agent raised {type(exc).__name__}: {str(exc)[:400]}{raised_at(exc)}"
        with self._cond:
            if run.running:
                if error is not None:
                    self._end(run, "failed", error)
                elif not run.calls:
                    self._end(run, "failed", "the agent returned without calling the model")
                else:
                    reward, problem = _checked_reward(result)
                    if problem:
                        self._end(run, "failed", problem)
                    else:
                        run.reward = reward
                        self._end(run, "stop")
            elif error is None and run.finish != "failed":
                # ended by a budget: a reward the agent still computed is its to give
                run.reward = _checked_reward(result)[0]
            self._cond.notify_all()

    def _next_batch(self, runs: list[_Run]) -> list[_Call] | None:
        """The driver: the calls of the next engine request, or None once every agent is done."""
        started = time.monotonic()
        with self._cond:
            try:
                while True:
                    alive = [run for run in runs if run.running]
                    if not alive:
                        return None
                    now = time.monotonic()
                    waiting = [run for run in alive if run.pending is not None and not run.pending.taken]
                    # The batch closes when every agent waits, or when calls stopped arriving for
                    # the window while no agent is still before its first call (agents start
                    # together: their first calls are one batch). A straggler sent alone later
                    # costs a whole extra decode; an agent in a slow tool costs the others the window.
                    starting = any(not run.calls and run.pending is None for run in alive)
                    if waiting and (len(waiting) == len(alive) or not starting
                                    and now - max(run.since for run in waiting) >= self.batch_window_s):
                        waiting = [run.pending for run in waiting]
                        for call in waiting:
                            call.taken = True
                        return waiting
                    for run in alive:
                        if run.pending is None and now - run.since > self.settings.env_timeout_s:
                            self._end(run, "failed", f"the agent made no call and did not return within "
                                                     f"rollout.env_timeout_s={self.settings.env_timeout_s:g} s")
                    self._cond.wait(timeout=min(self.batch_window_s, 1.0) / 2)
            finally:
                self.env_wall_s += time.monotonic() - started

    # ---- the endpoint (HTTP threads) ----------------------------------------------------------

    def _on_call(self, token: str, body: dict) -> dict:
        with self._cond:
            # looked up by digest, then compared in constant time: how long a refusal takes says nothing
            # about how much of a token was right
            run = self._runs.get(_digest(token))
            if run is None or not hmac.compare_digest(run.token.encode(), token.encode()):
                raise EndpointError(404, "no running trajectory has this base URL (it ended or never existed)")
            if not run.running:
                raise EndpointError(400, f"this trajectory has ended ({run.finish}); further calls are not recorded")
            if run.pending is not None:
                raise EndpointError(409, "this trajectory already has a call in flight; an agent's calls to the "
                                         "policy are sequential")
        call = self._prepare(run, body, run.params)  # renders outside the lock: tokenizers are slow
        with self._cond:
            if not run.running:
                raise EndpointError(400, f"this trajectory has ended ({run.finish})")
            run.pending, run.since = call, time.monotonic()
            self._cond.notify_all()
        call.done.wait()
        if call.response is None:
            raise EndpointError(400, f"this trajectory has ended ({run.finish}): {run.error or ''}")
        return call.response

    def _prepare(self, run: _Run, body: dict, params: SamplingParams) -> _Call:
        """The request's prompt ids, how they relate to the trajectory's tokens, and its budget.
        A request that breaks a budget ends the trajectory (truncation) and is answered 400."""
        if body.get("stream"):
            raise EndpointError(400, "stream=true is not supported: the rollout records whole completions")
        if body.get("n", 1) != 1:
            raise EndpointError(400, f"n={body.get('n')}: one completion per call (the group is the rollout's)")
        messages = request_messages(body.get("messages"))
        tools = body.get("tools") or None
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise EndpointError(400, "tools must be a list of {'type': 'function', 'function': {...}}")
        history = [normalized(message) for message in messages]
        tools_key = json.dumps(tools, sort_keys=True)
        current = run.segments[-1] if run.segments else None
        appended: list[int] = []
        new_segment = True
        extends = (current is not None and run.tools_key == tools_key and run.history is not None
                   and history[:len(run.history)] == run.history and len(history) > len(run.history)
                   and all(m[0] != "assistant" for m in history[len(run.history):]))
        try:
            if extends:
                # the new tool / user messages after the reply, rendered once after the sampled ids
                appended = self.chat.observation_ids(template_messages(messages[len(run.history):], None),
                                                     current.last_turn[-1] if current.last_turn else None)
                prompt = current.tokens + appended
                new_segment = False
            else:
                prompt = self.chat.prompt_ids(template_messages(messages, self.chat.tool_call_format), tools)
                if current is not None and prompt[:len(current.tokens)] == current.tokens:
                    appended, new_segment = prompt[len(current.tokens):], False
        except ValueError as exc:
            raise EndpointError(400, f"cannot render these messages with the model's chat template: {exc}") from None
        with self._cond:
            if len(run.calls) >= self.settings.max_turns:
                self._end(run, "max_turns", None)
                raise EndpointError(400, f"rollout.max_turns={self.settings.max_turns} calls reached")
            used = 0 if new_segment else len(current.ids) + len(appended)
            room = self.settings.max_model_len - len(prompt)
            if self.settings.max_total_tokens is not None:
                room = min(room, self.settings.max_total_tokens - used)
            if room < 1:
                self._end(run, "length", None)
                raise EndpointError(400, "the trajectory's token budget (rollout.max_total_tokens / max_model_len) "
                                         "is used up")
        cap = params.max_tokens
        for key in ("max_completion_tokens", "max_tokens"):
            if isinstance(body.get(key), int) and body[key] >= 1:
                cap = min(cap, body[key])
        return _Call(prompt, min(cap, room), turn_seed(params.prompt_seed(run.group), run.sample, len(run.calls)),
                     history, tools, new_segment, appended)

    # ---- the engine's answers (the driver) ----------------------------------------------------

    def _deliver(self, calls: list[_Call], samples: list[Sample]) -> None:
        with self._cond:
            for call, sample in zip(calls, samples):
                run = next(r for r in self._runs.values() if r.pending is call)
                self._record(run, call, sample)
                run.pending, run.since = None, time.monotonic()
                call.done.set()
            self._cond.notify_all()

    def _record(self, run: _Run, call: _Call, sample: Sample) -> None:
        if call.new_segment:
            if run.segments:
                run.new_segments += 1
            run.segments.append(_Segment(list(call.prompt_ids)))
        else:
            run.segments[-1].append_observation(call.appended)
        segment = run.segments[-1]
        tokens = list(sample.response_token_ids)
        versions = sample.extras.get("versions")
        segment.ids += tokens
        segment.logprobs += [float(v) for v in sample.logprobs]
        segment.mask += [1] * len(tokens)
        if versions is not None or segment.versions is not None:
            segment.versions = (segment.versions or [0] * (len(segment.ids) - len(tokens))) + \
                list(versions or [0] * len(tokens))
        segment.routes = sample.extras.get("routed_experts")
        segment.last_turn = tokens
        run.model_tokens += len(tokens)
        run.calls.append({"segment": len(run.segments) - 1, "prompt_tokens": len(call.prompt_ids),
                          "sampled_tokens": len(tokens), "version": None if not versions else min(versions)})
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        call_id = f"{run.token}-{len(run.calls) - 1}"
        message = reply_message(text, call.tools, self.chat.tool_call_format, call_id)
        run.tool_calls += len(message.get("tool_calls") or ())
        run.malformed_calls += bool(call.tools and not message.get("tool_calls")
                                    and has_tool_call_start(text, self.chat.tool_call_format))
        run.history = call.history + [normalized(message)]
        run.tools_key = json.dumps(call.tools, sort_keys=True)
        finish = "tool_calls" if message.get("tool_calls") else sample.finish_reason
        call.response = completion(message, finish, len(call.prompt_ids), tokens, sample.logprobs, call_id)
        # where the call landed, for an agent's own logs (not an OpenAI field; clients ignore it)
        call.response["trajectory"] = {"call": len(run.calls) - 1, "segment": len(run.segments) - 1}

    def _end(self, run: _Run, finish: str, error: str | None = None, *, final: bool = False) -> None:
        """Under the lock: the trajectory is over; a call still waiting is answered 400 (a call
        in the engine's batch is left to `_deliver`, unless the rollout itself is ending)."""
        if run.finish is None:
            run.finish, run.error = finish, error
        if run.pending is not None and (not run.pending.taken or final):
            run.pending.done.set()
            run.pending = None

    # ---- the result ---------------------------------------------------------------------------

    def _sample(self, run: _Run) -> Sample:
        if not run.segments:  # a failed agent that never reached the engine: an empty placeholder
            run.segments.append(_Segment([]))
        *earlier, last = run.segments
        agent = {"turns": len(run.calls), "finish": run.finish, "status": "failed" if run.finish == "failed" else "ok",
                 "reward": run.reward if run.finish != "failed" else None,
                 "info": {"calls": float(len(run.calls)), "new_segments": float(run.new_segments),
                          "sampled_tokens": float(run.model_tokens),
                          "tool_calls": float(run.tool_calls + run.malformed_calls),
                          "malformed_calls": float(run.malformed_calls)},
                 "env_time_s": 0.0, "error": run.error, "model_tokens": run.model_tokens, "calls": run.calls}
        truncated = run.finish in ("length", "max_turns")
        sample = _segment_sample(run, last, "length" if truncated else "stop")
        sample.extras.update({"final_response_ids": last.last_turn, "agent": agent,
                              "segments": [_segment_sample(run, segment, "stop") for segment in earlier]})
        return sample


def _segment_sample(run: _Run, segment: _Segment, finish: str) -> Sample:
    extras: dict[str, Any] = {"loss_mask": segment.mask}
    routes = segment.routes
    if routes is not None and routes.shape[0] == len(segment.tokens) - 1:
        extras["routed_experts"] = routes
    if segment.versions is not None:
        extras["versions"] = segment.versions
    return Sample(run.group, run.sample, segment.prompt_ids, segment.ids, segment.logprobs, finish, extras)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _record_dict(record) -> dict:
    prompt = record.prompt if isinstance(record.prompt, str) else [dict(m) for m in record.prompt]
    return {"prompt": prompt, "answer": record.answer, "metadata": dict(record.metadata)}


def _checked_reward(value: Any) -> tuple[float | None, str | None]:
    if value is None:
        return None, None
    try:
        reward = float(value)
    except (TypeError, ValueError):
        return None, f"the agent returned {value!r}, not a reward (a number or None)"
    if reward != reward or reward in (float("inf"), float("-inf")):
        return None, f"the agent returned a non-finite reward {reward}"
    return reward, None


async def _awaited(value):
    return await value if inspect.isawaitable(value) else value


def load_agent(path: str, args: dict, where: str = "rollout.agent") -> Callable:
    """The agent function at `path` ("pkg.module:function"), imported and its signature checked
    against `args` at start-up, before any model is built."""
    agent = import_callable(path, where, "pkg.module:function")
    try:
        inspect.signature(agent).bind("http://127.0.0.1:1/v1", {}, **args)
    except TypeError as exc:
        raise ConfigError(f"{where}={path!r} must take (base_url, record, **rollout.agent_args): {exc}") from exc
    except ValueError:
        pass  # no signature to check
    return agent
