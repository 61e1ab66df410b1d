"""Score a batch of responses with one or more weighted reward functions, never stopping the run.

    scorer = RewardScorer([RewardTerm("math"), RewardTerm("format", weight=0.1)], timeout_s=10)
    result = scorer.score([RewardInput(prompt, response, answer, metadata), ...])
    result.rewards        # per sample: sum over terms of weight * reward
    result.metrics()      # {"reward/mean": ..., "reward/errors": ..., "reward/timeouts": ..., ...}
    scorer.close()        # or use it as a context manager

Isolation: a sample whose reward function raises, returns a non-number, crashes its process or
exceeds ``timeout_s`` scores 0.0 for that term and is counted (``errors`` / ``timeouts``, with the
first message kept for the log); the batch always completes. Where each term runs:

* inline, in the calling process, without a timeout: only built-ins marked ``inline_safe``
  (synthetic verifiers, the boxed format check), whose cost is linear in the text length.
  Exceptions are still caught per sample. This keeps the common tiny-model case free of any
  process or pickling cost.
* in worker processes with a hard timeout (``workers.py``): everything else, i.e. user
  functions by import path (always), the math verifier (sympy can hang on adversarial output;
  its pure-Python ``fast_path`` still decides most samples inline first) and format regexes.

``RewardTerm.isolation`` overrides the choice: "process" forces workers for a built-in;
"inline" is refused for anything not inline-safe, because an unbounded function in the trainer
process could stall the run.

Batched functions (``functions.py``: declared by the term's ``batched`` setting, the ``@batched``
marker, or a first parameter named ``prompts``) always run in the workers. A batch's samples
needing a term are cut into ``min(num_workers, n)`` contiguous chunks of near-equal size, one
call each, so all workers stay busy; they share the pool with the per-sample calls of other
terms. The hard timeout applies per call, i.e. per chunk: ``batch_timeout_s`` (default
``timeout_s``). A call that raises, returns a result of the wrong length, crashes its worker,
cannot be pickled or times out scores 0.0 for every sample of the chunk, each counted as an error
(or timeout) with the call's message; an element that is not a finite number is an error for
that sample only.

Determinism: the rewards of a sample depend only on the sample and the functions, not on which
worker ran it or in what order (nor, for a batched function that scores each sample on its own,
on how the batch was chunked); only whether a slow call crosses its timeout depends on time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

from megatron_rl.errors import ConfigError
from megatron_rl.rewards.functions import RewardFunction, RewardValueError, as_reward
from megatron_rl.rewards.registry import BUILTIN_REWARDS, absolute_reward_name, resolve_reward
from megatron_rl.rewards.workers import BatchCall, Call, Outcome, WorkerPool

__all__ = ["RewardTerm", "RewardInput", "ScoreResult", "RewardScorer"]

Isolation = Literal["auto", "inline", "process"]
ISOLATIONS = ("auto", "inline", "process")


@dataclass(frozen=True)
class RewardTerm:
    """One weighted reward function: ``name`` as in ``registry.py``, ``params`` for it.

    ``label`` names the term in metrics (default: the name). ``batched``: True / False declares
    whether the function takes lists (``functions.py``); None detects it from the function.
    """

    name: str
    weight: float = 1.0
    params: Mapping[str, Any] = field(default_factory=dict)
    isolation: Isolation = "auto"
    label: str | None = None
    batched: bool | None = None

    @property
    def key(self) -> str:
        return self.label or self.name


@dataclass(frozen=True)
class RewardInput:
    """One sample to score (see ``functions.py`` for what each field means)."""

    prompt: str
    response: str
    answer: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class ScoreResult:
    rewards: list[float]  # weighted sum over terms, per sample
    per_term: dict[str, list[float]]  # unweighted reward per term key, per sample
    errors: int = 0  # samples x terms that raised, returned a non-number or crashed a worker
    timeouts: int = 0  # samples x terms that ran past the timeout
    term_errors: dict[str, int] = field(default_factory=dict)
    term_timeouts: dict[str, int] = field(default_factory=dict)
    first_error: str | None = None  # "term 'x', sample 3: ValueError: ..." (errors or timeouts)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {
            "reward/mean": _mean(self.rewards),
            "reward/errors": float(self.errors),
            "reward/timeouts": float(self.timeouts),
            # samples x terms: what errors + timeouts are out of (all of them failing stops a run)
            "reward/calls": float(sum(len(values) for values in self.per_term.values())),
        }
        for key, values in self.per_term.items():
            out[f"reward/{key}/mean"] = _mean(values)
            out[f"reward/{key}/errors"] = float(self.term_errors.get(key, 0))
            out[f"reward/{key}/timeouts"] = float(self.term_timeouts.get(key, 0))
        return out


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


class RewardScorer:
    """Resolves the terms once (ConfigError if any is invalid), then scores batches."""

    def __init__(self, terms: Sequence[RewardTerm], *, timeout_s: float = 10.0, num_workers: int = 2,
                 startup_timeout_s: float = 120.0, start_method: str | None = None,
                 batch_timeout_s: float | None = None):
        if not terms:
            raise ConfigError("rewards: at least one reward term is needed")
        for key, value in (("timeout_s", timeout_s), ("batch_timeout_s", batch_timeout_s)):
            if key == "batch_timeout_s" and value is None:
                continue
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"rewards.{key} must be a number > 0, got {value!r}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ConfigError(f"rewards.num_workers must be an integer >= 1, got {num_workers!r}")
        keys = [term.key for term in terms]
        duplicate = next((key for key in keys if keys.count(key) > 1), None)
        if duplicate is not None:
            raise ConfigError(f"rewards: two terms are named {duplicate!r}; give one a label")
        self.terms = list(terms)
        self.functions: list[RewardFunction] = []
        self.in_process: list[bool] = []
        self.batched: list[bool] = []
        for index, term in enumerate(self.terms):
            where = f"rewards.terms[{index}]"
            if term.isolation not in ISOLATIONS:
                raise ConfigError(f"{where}: isolation must be one of {', '.join(ISOLATIONS)}, got {term.isolation!r}")
            weight = term.weight
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ConfigError(f"{where}: weight must be a finite number, got {term.weight!r}")
            try:
                function = resolve_reward(absolute_reward_name(term.name), term.params)
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from exc
            if term.isolation == "inline" and not function.inline_safe:
                raise ConfigError(
                    f"{where}: isolation='inline' is only allowed for built-in rewards that cannot hang; "
                    "this one needs a worker process with a timeout"
                )
            self.functions.append(function)
            self.batched.append(_term_batched(term, function, where))
            # Batched functions are user functions, never inline-safe: they always go to workers.
            self.in_process.append(term.isolation == "inline" or (term.isolation == "auto" and function.inline_safe))
        # Workers get (name, params) and resolve the functions themselves (closures do not pickle).
        self.pool = WorkerPool(
            [(absolute_reward_name(term.name), dict(term.params)) for term in self.terms],
            num_workers=num_workers, timeout_s=timeout_s, startup_timeout_s=startup_timeout_s,
            start_method=start_method, batch_timeout_s=batch_timeout_s,
        )

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Start the worker processes now (optional: the first batch needing them starts them)."""
        if not all(self.in_process):
            self.pool.start()

    def close(self) -> None:
        self.pool.close()

    def score(self, samples: Sequence[RewardInput]) -> ScoreResult:
        outcomes: dict[tuple[int, int], Outcome] = {}  # (term, sample) -> outcome
        calls: list[Call | BatchCall] = []
        call_keys: list[list[tuple[int, int]]] = []  # per call: the (term, sample) pairs it scores
        for t, function in enumerate(self.functions):
            if self.batched[t]:
                for chunk in _chunks(len(samples), self.pool.num_workers):
                    calls.append(_batch_call(t, [samples[s] for s in chunk]))
                    call_keys.append([(t, s) for s in chunk])
                continue
            for s, sample in enumerate(samples):
                if self.in_process[t]:
                    outcomes[t, s] = _run_inline(function.fn, sample)
                    continue
                if function.fast_path is not None:
                    fast = _run_inline(function.fast_path, sample, allow_none=True)
                    if fast is not None:
                        outcomes[t, s] = fast
                        continue
                calls.append(Call(t, sample.prompt, sample.response, sample.answer, dict(sample.metadata)))
                call_keys.append([(t, s)])
        if calls:
            for keys, outcome in zip(call_keys, self.pool.run(calls)):
                # One outcome for a whole batch call (it raised, crashed, timed out) counts for each sample.
                per_sample = outcome if isinstance(outcome, list) else [outcome] * len(keys)
                outcomes.update(zip(keys, per_sample))
        return self._combine(outcomes, len(samples))

    def _combine(self, outcomes: dict[tuple[int, int], Outcome], n: int) -> ScoreResult:
        result = ScoreResult(rewards=[0.0] * n, per_term={})
        for t, term in enumerate(self.terms):
            values = []
            for s in range(n):
                outcome = outcomes[t, s]
                values.append(outcome.value)
                result.rewards[s] += term.weight * outcome.value
                if outcome.status == "ok":
                    continue
                if outcome.status == "timeout":
                    result.timeouts += 1
                    result.term_timeouts[term.key] = result.term_timeouts.get(term.key, 0) + 1
                else:
                    result.errors += 1
                    result.term_errors[term.key] = result.term_errors.get(term.key, 0) + 1
                if result.first_error is None:
                    result.first_error = f"term {term.key!r}, sample {s}: {outcome.message}"
            result.per_term[term.key] = values
        return result


def _term_batched(term: RewardTerm, function: RewardFunction, where: str) -> bool:
    if term.batched is None:
        return function.batched
    if term.batched and term.name in BUILTIN_REWARDS:
        raise ConfigError(f"{where}: batched=true needs a user function; the built-in {term.name!r} is per-sample")
    return bool(term.batched)


def _chunks(n: int, parts: int) -> list[range]:
    """``range(n)`` cut into min(parts, n) contiguous pieces whose sizes differ by at most one."""
    parts = max(1, min(parts, n))
    bounds = [n * i // parts for i in range(parts + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(parts) if bounds[i] < bounds[i + 1]]


def _batch_call(fn_index: int, samples: Sequence[RewardInput]) -> BatchCall:
    # One list per metadata field, in first-seen order; a sample without the field gets None.
    names = list(dict.fromkeys(name for sample in samples for name in sample.metadata))
    columns = {name: [sample.metadata.get(name) for sample in samples] for name in names}
    return BatchCall(fn_index, [s.prompt for s in samples], [s.response for s in samples],
                     [s.answer for s in samples], columns)


def _run_inline(fn, sample: RewardInput, allow_none: bool = False) -> Outcome | None:
    try:
        value = fn(sample.prompt, sample.response, sample.answer, **sample.metadata)
        if value is None and allow_none:
            return None
        return Outcome("ok", as_reward(value))
    except RewardValueError as exc:
        return Outcome("error", 0.0, str(exc))
    except Exception as exc:
        return Outcome("error", 0.0, f"{type(exc).__name__}: {exc}")
