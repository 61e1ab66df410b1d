"""Format rewards: does the response have the shape the task asks for?

Two modes, picked by the ``pattern`` parameter:

* no pattern: the response ends with exactly one complete ``\\boxed{...}`` answer; after it only
  whitespace and closing punctuation (``$``, ``.``, ``\\]``, ``\\)``) may follow.
* ``pattern``: a regular expression the whole response must match (``re.fullmatch`` with
  DOTALL, so ``.`` spans lines); write ``.*`` where free text is allowed.

Both return ``value`` (default 1.0) when the format holds and 0.0 otherwise, so the term's
weight and ``value`` set the bonus. The boxed check is linear in the text length. A configured
regular expression is not: Python's ``re`` can backtrack exponentially on a badly written
pattern, so the registry marks pattern mode as not inline-safe and the scorer runs it under a
timeout.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from megatron_rl.errors import ConfigError
from megatron_rl.rewards.math_answer import BOXED_OPEN, closing_brace

__all__ = ["ends_with_one_boxed", "make_format_reward"]

def ends_with_one_boxed(response: str) -> bool:
    """Exactly one ``\\boxed{`` in the response, complete, and nothing but punctuation after it."""
    openers = list(BOXED_OPEN.finditer(response))
    if len(openers) != 1:
        return False
    close = closing_brace(response, openers[0].end())
    if close is None:
        return False
    # String operations, not a regex: "[\s.]*x" style patterns backtrack quadratically.
    trailer = response[close + 1 :].replace("\\]", "").replace("\\)", "")
    return trailer.strip(" \t\r\n$.") == ""


def make_format_reward(pattern: str | None = None, value: float = 1.0) -> Callable[..., float]:
    """A reward function (see ``functions.py``) for the configured format; ConfigError if invalid."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"format reward: value must be a number, got {value!r}")
    if pattern is None:

        def boxed_format_reward(prompt: str, response: str, answer: str | None = None, **metadata: Any) -> float:
            return float(value) if ends_with_one_boxed(response) else 0.0

        return boxed_format_reward
    if not isinstance(pattern, str):
        raise ConfigError(f"format reward: pattern must be a string, got {pattern!r}")
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as exc:
        raise ConfigError(f"format reward: pattern {pattern!r} is not a valid regular expression: {exc}") from exc

    def pattern_format_reward(prompt: str, response: str, answer: str | None = None, **metadata: Any) -> float:
        return float(value) if compiled.fullmatch(response) else 0.0

    return pattern_format_reward
