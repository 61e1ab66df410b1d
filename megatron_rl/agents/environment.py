"""What an environment is to the multi-turn rollout, and how one is named in a config.

    rollout.environment: "my_pkg.envs:GuessNumber"     # a class (or factory), one instance per trajectory
    rollout.environment_args: {max_guess: 100}         # keyword arguments of its constructor

    class GuessNumber(Environment):
        def reset(self, record):                       # the dataset row (prompt, answer, metadata)
            self.target = int(record.answer)
            return Observation()                       # no messages: the record's prompt is the first turn
        def step(self, response_text, response_ids):   # the model's turn, as the engine sampled it
            guess = int(response_text.strip() or -1)
            if guess == self.target:
                return Observation(reward=1.0, done=True)
            hint = "higher" if guess < self.target else "lower"
            return Observation(messages=[{"role": "user", "content": hint}], info={"guesses": 1})

Contract (the rollout enforces it; a breach fails the trajectory, never the step):
- `reset(record) -> Observation`: the first turn. `messages` (chat messages, rendered with the
  model's chat template and the generation prompt, tools included) or `token_ids` (used as
  they are); neither: the record's prompt, encoded as for single-turn training.
- `step(response_text, response_ids) -> Observation`: the answer to one model turn: the next
  observation (`messages` for the template's user/tool roles, or ready `token_ids`, never the
  model's own tokens again), a turn `reward` (optional; combined by `rollout.turn_reward`),
  `done`, and `info` (numbers, averaged into the step's metrics as `agent/info/<key>`).
- Either may be `async def`. Calls run in a thread pool, so a slow environment delays only its
  own trajectory; one slower than `rollout.env_timeout_s`, or one that raises or returns
  something else than an Observation, ends its trajectory as `failed` (not a wrong answer).
- `close()` (optional) is called once the trajectory ends, whatever the outcome.

A trajectory whose environment never gave a reward is scored by the run's reward functions
(`rewards.terms`) on the model's last turn, so a tool-using task can reuse a rule verifier.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

from megatron_rl.errors import ConfigError


@dataclass
class Observation:
    """One environment answer; see the module docstring."""

    messages: list[dict] | None = None
    token_ids: list[int] | None = None
    reward: float | None = None
    done: bool = False
    info: dict[str, float] = field(default_factory=dict)


class Environment:
    """Base class for environments (any object with `reset` and `step` will do)."""

    def reset(self, record) -> Observation:
        return Observation()

    def step(self, response_text: str, response_ids: list[int]) -> Observation:
        raise NotImplementedError

    def close(self) -> None:
        pass


class EnvironmentFailure(Exception):
    """An environment broke its contract or its call failed: the trajectory is `failed`."""


def import_callable(path: str, where: str, shape: str) -> Callable:
    """The callable at `path` ("pkg.module:name"); ConfigError naming `where` when it cannot be
    imported or is not callable (`shape`: what the user should have written, for the message)."""
    module_name, _, attribute = (path or "").partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{where}={path!r} must be '{shape}'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
        raise ConfigError(f"{where}={path!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc}); "
                          f"is its package installed or on PYTHONPATH?") from exc
    target = getattr(module, attribute, None)
    if target is None:
        raise ConfigError(f"{where}={path!r}: module {module_name!r} has no {attribute!r}")
    if not callable(target):
        raise ConfigError(f"{where}={path!r} is not callable ('{shape}')")
    return target


def load_environment_factory(path: str, args: dict, where: str = "rollout.environment") -> Callable[[], Any]:
    """A zero-argument factory of fresh environments for `path` ("pkg.module:Name"). Imported and
    checked at start-up, before any model is built; nothing is constructed here."""
    target = import_callable(path, where, "pkg.module:Class")
    if inspect.isclass(target):
        missing = [name for name in ("reset", "step") if not callable(getattr(target, name, None))]
        if missing:
            raise ConfigError(f"{where}={path!r}: the class has no {' or '.join(missing)} method (see "
                              f"megatron_rl.agents.Environment)")
    try:
        inspect.signature(target).bind(**args)
    except TypeError as exc:
        raise ConfigError(f"rollout.environment_args do not fit {path!r}: {exc}") from exc
    except ValueError:
        pass  # no signature to check (a builtin): the first reset will tell
    return lambda: target(**args)


def call_maybe_async(function: Callable, *args) -> Any:
    """Run `function(*args)` in this (worker) thread, awaiting it when it is a coroutine."""
    result = function(*args)
    if inspect.isawaitable(result):
        return asyncio.run(_awaited(result))
    return result


async def _awaited(awaitable):
    return await awaitable


def check_observation(value: Any, what: str) -> Observation:
    """`value` as a valid Observation, or EnvironmentFailure saying what is wrong with it."""
    if not isinstance(value, Observation):
        raise EnvironmentFailure(f"{what} returned {type(value).__name__}, not an Observation")
    if value.messages is not None and value.token_ids is not None:
        raise EnvironmentFailure(f"{what} returned both messages and token_ids")
    if value.messages is not None:
        if not isinstance(value.messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in value.messages):
            raise EnvironmentFailure(f"{what} returned messages that are not [{{'role': str, 'content': str}}, ...]")
    if value.token_ids is not None and not (isinstance(value.token_ids, list)
                                            and all(isinstance(t, int) and t >= 0 for t in value.token_ids)):
        raise EnvironmentFailure(f"{what} returned token_ids that are not a list of non-negative ints")
    if value.reward is not None:
        try:
            reward = float(value.reward)
        except (TypeError, ValueError):
            raise EnvironmentFailure(f"{what} returned reward {value.reward!r}, not a number") from None
        if reward != reward or reward in (float("inf"), float("-inf")):
            raise EnvironmentFailure(f"{what} returned a non-finite reward {reward}")
        value.reward = reward
    if not isinstance(value.info, dict):
        raise EnvironmentFailure(f"{what} returned info that is not a dict")
    info = {}
    for key, number in value.info.items():
        try:
            info[str(key)] = float(number)
        except (TypeError, ValueError):
            raise EnvironmentFailure(f"{what} returned info[{key!r}]={number!r}, not a number") from None
    value.info = info
    value.done = bool(value.done)
    return value
