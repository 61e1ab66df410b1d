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

It returns a finite real number (bool and int are accepted and converted). Anything else (None, a
string, NaN, inf) is an error for that sample, scored 0.0 and counted, exactly like an exception.

``RewardFunction`` is what the registry resolves a name to: the callable plus what the scorer
needs to know to run it safely (see ``scoring.py``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Protocol

__all__ = ["RewardFn", "RewardFunction", "RewardValueError", "as_reward"]


class RewardFn(Protocol):
    def __call__(self, prompt: str, response: str, answer: str | None, **metadata: Any) -> float: ...


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
    """

    name: str
    fn: Callable[..., Any]
    inline_safe: bool = False
    fast_path: Callable[..., Any] | None = None
    prepare: Callable[[], None] | None = None


class RewardValueError(ValueError):
    """A reward function returned something that is not a finite real number."""


def as_reward(value: Any) -> float:
    """The float a reward function's return value stands for, or RewardValueError."""
    # numbers.Real covers int, float, bool, fractions and numpy scalars; complex and strings fail.
    if not isinstance(value, numbers.Real):
        raise RewardValueError(f"returned {value!r} ({type(value).__name__}), expected a finite float")
    result = float(value)
    if not math.isfinite(result):
        raise RewardValueError(f"returned {result}, expected a finite float")
    return result
