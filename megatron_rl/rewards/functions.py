"""The reward-function contract: what a reward function is and what it may return.

A reward function is any callable

    fn(prompt: str, response: str, answer: str | None, **metadata) -> float

* ``prompt``: the prompt text the model answered (for chat-message prompts, the last user
  message; see ``megatron_rl.data.prompts.prompt_text``).
* ``response``: the generated text, decoded without special tokens (no EOS / pad text).
* ``answer``: the dataset's reference answer, or None when the dataset has none.
* ``metadata``: every other field of the prompt record (for synthetic tasks: ``task``,
  ``response_format``, ``target``), plus the term's configured ``params`` (which win over a
  record field of the same name). Functions should accept ``**metadata`` and ignore what they do
  not use, so that datasets can grow fields without breaking them.

It returns a finite real number of magnitude at most MAX_ABS_REWARD (bool and int are accepted and
converted). Anything else (None, a string, NaN, inf, 1e308) is an error for that sample, scored 0.0
and counted, exactly like an exception: a reward of 1e308 is finite, but a group's mean and variance
of such rewards overflow, and the advantages would be NaN.

Batched reward functions score many samples in one call (a model judge, vectorized checks):

    fn(prompts: list[str], responses: list[str], answers: list[str | None], **columns) -> list[float]

* each metadata field becomes one list ``columns[name]`` with a value per sample, in order (a
  field some samples lack is None for those);
* the term's configured ``params`` are passed as they are, as plain keyword values (not lists:
  they are the same for every sample), and win over a column of the same name;
* it returns one reward per sample (a list, tuple or 1-D array of the same length). A result of
  another length, or that is not a sequence, is an error for every sample of the call; an
  element that is not a finite real number is an error for that sample only.

Detection rule, in this order: the reward term's ``batched`` setting (true / false) when given;
else a function marked with the ``@batched`` decorator below; else a function whose first
parameter is named ``prompts``. Everything else is per-sample. Only user functions
("module:function", "file.py:function") can be batched; the built-ins are per-sample.
How batches are split across the worker processes, and what the timeout covers, is described in
``scoring.py``.

``RewardFunction`` is what the registry resolves a name to: the callable plus what the scorer
needs to know to run it safely (see ``scoring.py``).
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

__all__ = [
    "BATCHED_ATTRIBUTE", "CORRECT", "MAX_ABS_REWARD", "BatchedRewardFn", "RewardFn", "RewardFunction",
    "RewardValueError", "as_batch_rewards", "as_reward", "batched", "is_batched",
]

# The attribute ``@batched`` sets on a function (checked with getattr, so methods work too).
BATCHED_ATTRIBUTE = "__megatron_rl_batched__"
# The largest reward magnitude taken: a group's sum and squared deviations stay far from float64's
# limit (1.8e308), and the advantages of an estimator without a std from float32's (3.4e38).
MAX_ABS_REWARD = 1e30
# A sample counts as correct when its reward reaches this (rule rewards are 0 or 1): the one
# threshold of the trainer's accuracy, the response statistics and the evaluation runner.
CORRECT = 0.5


class RewardFn(Protocol):
    def __call__(self, prompt: str, response: str, answer: str | None, **metadata: Any) -> float: ...


class BatchedRewardFn(Protocol):
    def __call__(self, prompts: list[str], responses: list[str], answers: list[str | None],
                 **columns: Any) -> Sequence[float]: ...


@dataclass(frozen=True)
class RewardFunction:
    """A resolved reward function.

    name: how the configuration referred to it ("math", "synthetic:add", "pkg.mod:fn").
    fn: the full reward function (contract above).
    inline_safe: True only for functions shipped with the package whose running time is linear
        in the text length and which never call into sympy or user code; the scorer may run
        these in the trainer process without a timeout (they cannot hang).
    fast_path: optional cheap, inline-safe pre-check with the same arguments that returns the
        reward when it can decide alone, or None when the full ``fn`` (possibly slow: sympy) is
        needed. Lets the common case of a process-isolated function skip the worker round trip.
    prepare: optional warm-up run once in each worker process before it takes samples (imports,
        first-call caches), so a sample's timeout does not pay for them.
    batched: ``fn`` takes lists (the batched contract above), as detected from the function; the
        reward term's ``batched`` setting can override it.
    """

    name: str
    fn: Callable[..., Any]
    inline_safe: bool = False
    fast_path: Callable[..., Any] | None = None
    prepare: Callable[[], None] | None = None
    batched: bool = False


class RewardValueError(ValueError):
    """A reward function returned something that is not a finite real number."""


def as_reward(value: Any) -> float:
    """The float a reward function's return value stands for, or RewardValueError."""
    # numbers.Real covers int, float, bool, fractions and numpy scalars; complex and strings fail.
    if not isinstance(value, numbers.Real):
        raise RewardValueError(f"returned {value!r} ({type(value).__name__}), expected a finite float")
    try:
        result = float(value)
    except OverflowError:  # an int beyond float's range
        raise RewardValueError(f"returned {value!r}, too large to be a reward (at most {MAX_ABS_REWARD:g} in "
                               "magnitude)") from None
    if not math.isfinite(result):
        raise RewardValueError(f"returned {result}, expected a finite float")
    if abs(result) > MAX_ABS_REWARD:
        raise RewardValueError(f"returned {result:g}, beyond the largest reward magnitude {MAX_ABS_REWARD:g}: the "
                               "group's mean and variance of such rewards overflow, so the advantages would be NaN; "
                               "scale the reward down")
    return result


def batched(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: declare ``fn`` a batched reward function (lists in, a list of rewards out)."""
    setattr(fn, BATCHED_ATTRIBUTE, True)
    return fn


def is_batched(fn: Callable[..., Any]) -> bool:
    """The detection rule of the module docstring, without the term's setting: marker, then name."""
    if getattr(fn, BATCHED_ATTRIBUTE, False):
        return True
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return bool(parameters) and parameters[0].name == "prompts" and parameters[0].kind in positional


def as_batch_rewards(values: Any, n: int) -> list[float | RewardValueError]:
    """Per sample, the float a batched function's result stands for, or the RewardValueError of that
    element. A result that is not a sequence of ``n`` values raises RewardValueError (every sample)."""
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__") or not hasattr(values, "__iter__"):
        raise RewardValueError(f"returned {type(values).__name__}, expected a list of {n} floats (one per sample)")
    if len(values) != n:
        raise RewardValueError(f"returned {len(values)} rewards for a call of {n} samples: expected length {n}, "
                               f"got {len(values)}")
    out: list[float | RewardValueError] = []
    for value in values:
        try:
            out.append(as_reward(value))
        except RewardValueError as exc:
            out.append(exc)
    return out
