"""Multi-turn rollouts: token in, token out, observations masked.

    agent = AgentRollout.from_config(config, tokenizer, model_type)
    groups = agent.run(records, params, generate, share)     # list per record of G Samples

Each of a record's G trajectories gets its own environment. A turn is one engine request for
every trajectory still running (`generate(prompts, params)`: token ids in, sampled ids and
logprobs out), then one environment step for each (the driver's, in a thread pool, bounded by
`rollout.env_timeout_s`), then the observation's tokens appended. The sequence a trajectory
trains on is exactly what the engine was given and sampled:

    prompt ids | turn 1 (sampled, mask 1) | observation 1 (rendered once, mask 0) | turn 2 ... | last turn

- The model's tokens are never decoded and re-encoded into the sequence: the decoded text only
  goes to the environment. Observations are rendered once by the chat-format adapter
  (agents/chat_format.py), separator after the model's end-of-turn token included, so each
  turn's prompt extends the previous one token for token (and vLLM reuses its prefix cache).
- Budgets: `rl.max_response_tokens` per turn, `rollout.max_total_tokens` after the prompt,
  `rollout.max_turns`. A turn cut by a budget ends the trajectory (`length`); an observation that
  does not fit is dropped and the trajectory ends (`length`); the last allowed turn still gets
  its environment step (for its reward), and ends `max_turns` unless the environment said done.
  `length` and `max_turns` are truncations (`rl.mask_truncated`).
- Failures: an environment call that raises, hangs past its timeout or returns something else
  than an Observation ends the trajectory `failed`. The step's scorer drops its whole group from
  training (a group's advantages would otherwise compare answers with an infrastructure error)
  and counts it (`agent/failed`, `agent/failed_groups`).
- Seeds: turn t of trajectory (group, sample) has its own seed derived from the request's seed,
  so a trajectory does not depend on which others are still running or how requests are split.
- Every rank runs the loop with the same samples (`generate` gives every rank the same answer);
  environments run on the driver only and `share` broadcasts their outcome, so environments with
  side effects run once and ranks cannot diverge.

The finished trajectory is one `Sample`: response ids = everything after the prompt, logprobs 0
on observation tokens, and in `extras`: `loss_mask` (1 on model tokens), `agent` (turns, status,
finish, combined environment reward, info, environment time), `final_response_ids` (the last
turn, what reward functions score), `routed_experts` (R3: the last request's routes, which cover
every token: observations were prefilled by the engine in the next turn), `versions` (async).
"""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from megatron_rl.agents.environment import (
    EnvironmentFailure,
    call_maybe_async,
    check_observation,
    load_environment_factory,
)
from megatron_rl.errors import raised_at
from megatron_rl.rollout.protocol import Sample, SamplingParams

Generate = Callable[[list[list[int]], SamplingParams], list[list[Sample]]]


@dataclass
class AgentSettings:
    max_turns: int
    max_total_tokens: int | None  # after the prompt (None: up to the engine's context)
    max_model_len: int  # the engine's context: prompt and everything after it
    turn_reward: str  # "last" | "sum"
    env_timeout_s: float


@dataclass
class _Trajectory:
    """One trajectory in progress (the driver's environment lives in `env`)."""

    group: int
    sample: int
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] | None = None
    last_turn: list[int] = field(default_factory=list)
    turns: int = 0
    model_tokens: int = 0
    rewards: list[float] = field(default_factory=list)
    info: dict[str, float] = field(default_factory=dict)
    env_time_s: float = 0.0
    finish: str | None = None  # None while running; stop | length | max_turns | failed
    error: str | None = None
    routes: Any = None
    env: Any = None

    @property
    def running(self) -> bool:
        return self.finish is None


@dataclass
class _EnvOutcome:
    """What the driver's environment call produced for one trajectory (broadcast to every rank)."""

    observation_ids: list[int] | None = None
    prompt_ids: list[int] | None = None  # reset only
    reward: float | None = None
    done: bool = False
    info: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None


class AgentRollout:
    def __init__(self, *, environment: Callable[[], Any], chat_format, tokenizer, settings: AgentSettings,
                 encode_record: Callable[[Any, list[dict] | None], list[int]], workers: int = 32):
        """`environment()`: a fresh environment; `encode_record(record, messages)`: the first
        prompt's ids (the record's prompt when `messages` is None), tools included."""
        self.environment, self.chat, self.tokenizer, self.settings = environment, chat_format, tokenizer, settings
        self.encode_record = encode_record
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="environment")
        self.env_wall_s = 0.0  # wall-clock seconds spent waiting on environments (the driver's), ever

    @classmethod
    def from_config(cls, config, tokenizer, chat_format, encode_record) -> AgentRollout:
        rollout = config.rollout
        if rollout.environment is not None:
            environment = load_environment_factory(rollout.environment, rollout.environment_args)
        else:
            from megatron_rl.agents.tool_env import ToolEnvironment
            from megatron_rl.agents.tools import ToolRegistry

            registry = ToolRegistry.from_paths(rollout.tools)
            environment = lambda: ToolEnvironment(registry, chat_format.tool_call_format)  # noqa: E731
        settings = AgentSettings(rollout.max_turns, rollout.max_total_tokens, rollout.max_model_len,
                                 rollout.turn_reward, rollout.env_timeout_s)
        return cls(environment=environment, chat_format=chat_format, tokenizer=tokenizer, settings=settings,
                   encode_record=encode_record, workers=rollout.env_workers)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- the loop -----------------------------------------------------------------------------

    def run(self, records: Sequence[Any], params: SamplingParams, generate: Generate,
            share: Callable[[Any], Any] = lambda value: value, is_driver: bool = True) -> list[list[Sample]]:
        """G = params.n trajectories per record, as Samples grouped by record. Collective when
        `share` broadcasts from the driver (every rank calls it with the same arguments)."""
        runs = [_Trajectory(group, sample) for group in range(len(records)) for sample in range(params.n)]
        try:
            outcomes = share(self._resets(records, runs) if is_driver else None)
            for run, outcome in zip(runs, outcomes):
                if outcome.error is not None:
                    run.finish, run.error = "failed", outcome.error
                else:
                    run.prompt_ids = outcome.prompt_ids
                run.env_time_s += outcome.seconds
            while any(run.running for run in runs):
                active = [run for run in runs if run.running]
                self._model_turn(active, params, generate)
                stepped = [run for run in active if run.running or run.finish == "max_turns"]
                outcomes = share(self._steps(stepped) if is_driver else None)
                for run, outcome in zip(stepped, outcomes):
                    self._apply(run, outcome)
        finally:
            if is_driver:
                self._close_all(runs)
        return [[self._sample(run, params) for run in runs[group * params.n:(group + 1) * params.n]]
                for group in range(len(records))]

    def _model_turn(self, active: list[_Trajectory], params: SamplingParams, generate: Generate) -> None:
        """One engine request for every running trajectory; their tokens appended (mask 1)."""
        budgets = [max(1, min(params.max_tokens, self._room(run))) for run in active]
        seeds = [turn_seed(params.prompt_seed(run.group), run.sample, run.turns) for run in active]
        request = replace(params, n=1, seed_offset=0, prompt_max_tokens=tuple(budgets),
                          prompt_seeds=tuple(seeds) if params.seed is not None else (),
                          stop_token_ids=tuple(dict.fromkeys((*params.stop_token_ids, *self.chat.stop_token_ids))))
        groups = generate([run.prompt_ids + run.ids for run in active], request)
        for run, (sample,) in zip(active, groups):
            tokens = list(sample.response_token_ids)
            version = sample.extras.get("versions")
            run.ids += tokens
            run.logprobs += [float(v) for v in sample.logprobs]
            run.mask += [1] * len(tokens)
            if version is not None or run.versions is not None:
                run.versions = (run.versions or []) + list(version or [0] * len(tokens))
            run.last_turn, run.turns, run.model_tokens = tokens, run.turns + 1, run.model_tokens + len(tokens)
            run.routes = sample.extras.get("routed_experts")
            if sample.finish_reason == "length":
                run.finish = "length"  # the turn hit its budget: the model never finished it
            elif run.turns >= self.settings.max_turns:
                run.finish = "max_turns"  # still stepped (its reward); done there ends it "stop"

    def _apply(self, run: _Trajectory, outcome: _EnvOutcome) -> None:
        run.env_time_s += outcome.seconds
        for key, value in outcome.info.items():
            run.info[key] = run.info.get(key, 0.0) + value
        if outcome.error is not None:
            run.finish, run.error = "failed", outcome.error
            return
        if outcome.reward is not None:
            run.rewards.append(outcome.reward)
        if outcome.done:
            run.finish = "stop"
            return
        if run.finish is not None:  # max_turns: no observation after the last turn
            return
        observation = outcome.observation_ids or []
        if len(observation) >= self._room(run):
            run.finish = "length"  # the observation would leave no room for another turn
            return
        run.ids += observation
        run.logprobs += [0.0] * len(observation)
        run.mask += [0] * len(observation)
        if run.versions is not None:
            run.versions += [run.versions[-1] if run.versions else 0] * len(observation)

    def _room(self, run: _Trajectory) -> int:
        """Tokens this trajectory may still add (model turns and observations)."""
        room = self.settings.max_model_len - len(run.prompt_ids) - len(run.ids)
        if self.settings.max_total_tokens is not None:
            room = min(room, self.settings.max_total_tokens - len(run.ids))
        return room

    # ---- environment calls (the driver) -------------------------------------------------------

    def _resets(self, records, runs: list[_Trajectory]) -> list[_EnvOutcome]:
        def reset(run: _Trajectory) -> _EnvOutcome:
            run.env = self.environment()
            observation = check_observation(call_maybe_async(run.env.reset, records[run.group]), "reset()")
            if observation.token_ids is not None:
                ids = list(observation.token_ids)
            else:
                ids = self.encode_record(records[run.group], observation.messages)
            return _EnvOutcome(prompt_ids=ids, info=observation.info)

        return self._call_all(runs, reset, "reset")

    def _steps(self, runs: list[_Trajectory]) -> list[_EnvOutcome]:
        def step(run: _Trajectory) -> _EnvOutcome:
            text = self.tokenizer.decode(run.last_turn, skip_special_tokens=True)
            observation = check_observation(call_maybe_async(run.env.step, text, list(run.last_turn)), "step()")
            ids = None
            if not observation.done and run.finish is None:
                if observation.token_ids is not None:
                    ids = list(observation.token_ids)
                elif observation.messages:
                    ids = self.chat.observation_ids(observation.messages, run.last_turn[-1] if run.last_turn else None)
                else:
                    raise EnvironmentFailure("step() returned no observation (messages or token_ids) and done=False")
            return _EnvOutcome(observation_ids=ids, reward=observation.reward, done=observation.done,
                               info=observation.info)

        return self._call_all(runs, step, "step")

    def _call_all(self, runs: list[_Trajectory], call: Callable[[_Trajectory], _EnvOutcome],
                  what: str) -> list[_EnvOutcome]:
        """`call(run)` for every run at once in the pool; each bounded by the timeout (a hung
        call is abandoned in its thread, its environment never touched again)."""
        started = time.perf_counter()
        futures = [self._pool.submit(_timed, call, run) for run in runs]
        try:
            return self._collect(runs, futures, started, what)
        finally:
            self.env_wall_s += time.perf_counter() - started

    def _collect(self, runs, futures, started: float, what: str) -> list[_EnvOutcome]:
        outcomes = []
        for run, future in zip(runs, futures):
            remaining = self.settings.env_timeout_s - (time.perf_counter() - started)
            try:
                outcomes.append(future.result(timeout=max(remaining, 0.0)))
            except FutureTimeout:
                run.env = None  # abandoned: still running in its thread
                outcomes.append(_EnvOutcome(seconds=self.settings.env_timeout_s,
                                            error=f"{what}() took longer than rollout.env_timeout_s="
                                                  f"{self.settings.env_timeout_s:g} s"))
            except Exception as exc:  # noqa: BLE001 - any environment error fails its trajectory only
                outcomes.append(_EnvOutcome(error=_failure(what, exc)))
        return outcomes

    def _close_all(self, runs: list[_Trajectory]) -> None:
        for run in runs:
            close = getattr(run.env, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001 - the trajectory is already over
                    pass
            run.env = None

    # ---- the result ---------------------------------------------------------------------------

    def _sample(self, run: _Trajectory, params: SamplingParams) -> Sample:
        reward = None
        if run.rewards:
            reward = run.rewards[-1] if self.settings.turn_reward == "last" else sum(run.rewards)
        routes = run.routes
        if routes is not None and routes.shape[0] != len(run.prompt_ids) + len(run.ids) - 1:
            routes = None  # cannot happen: the last request ran every token (see the module docstring)
        extras = {"loss_mask": run.mask, "final_response_ids": run.last_turn,
                  "agent": {"turns": run.turns, "finish": run.finish, "status": "failed" if run.finish == "failed"
                            else "ok", "reward": reward, "info": dict(run.info), "env_time_s": run.env_time_s,
                            "error": run.error, "model_tokens": run.model_tokens}}
        if routes is not None:
            extras["routed_experts"] = routes
        if run.versions is not None:
            extras["versions"] = run.versions
        truncated = run.finish in ("length", "max_turns")
        return Sample(run.group, run.sample, run.prompt_ids, run.ids, run.logprobs,
                      "length" if truncated else "stop", extras)


def _failure(what: str, exc: Exception) -> str:
    """A failed environment call as the trajectory's error: the exception and, for one the
    environment raised, where (its contract checks, EnvironmentFailure, say what was wrong)."""
    where = "" if isinstance(exc, EnvironmentFailure) else raised_at(exc)
    return f"{what}() raised {type(exc).__name__}: {str(exc)[:400]}{where}"


def _timed(call, run) -> _EnvOutcome:
    tick = time.perf_counter()
    outcome = call(run)
    outcome.seconds = time.perf_counter() - tick
    return outcome


def turn_seed(seed: int | None, sample: int, turn: int) -> int:
    """The engine seed of one trajectory's turn: a function of the prompt's seed, the sample's
    place in its group and the turn only."""
    digest = hashlib.blake2b(f"{seed}:{sample}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF
