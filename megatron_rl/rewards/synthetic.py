"""Synthetic verifiable tasks, generated from a seed: no download, exact answers, own verifiers.

They exist so that the built-in default can train a tiny model from scratch on a CPU in minutes
and show RL raising held-out accuracy. Prompts and answers are therefore compact and use only
the characters of the tiny tokenizer (``megatron_rl.data.tokenizer.ALPHABET``):

    task      prompt (defaults)     answer   knobs
    add       "12+7="               "19"     digits (operands < 10**digits), max_operand
    sort      "sort 3142="          "1234"   length
    reverse   "rev 3142="           "2413"   length
    count     "count a in abcab="   "2"      length, symbols
    modular   "17*5%7="             "1"      digits, max_operand, modulus
    mul       "123*456="            "56088"  digits (operands of exactly that many digits), max_operand;
                                             the agentic task: a tiny model cannot multiply, but it
                                             can call `calculator`
    expr      "f(3)=7 f(5)=9 f(x)=" "x+4"    forms, examples, shown_max, hidden_tests,
                                             general_demonstrations, digits / max_operand (the
                                             largest constant); the code task: a one-line Python
                                             expression in x, run on hidden inputs
    retry     "347+58="             "405"    digits, min_digits, attempts, retry_noise, check_miss;
                                             the reasoning-length task (below)
    pad       "347+58="             "405"    digits, min_digits, pad_max; its negative control
    pairs     "sum 13="             "13"     max_operand / digits; many correct answers ("6+7")

An `expr` record hides a function f of one form (``forms``: add "x+b", sub "x-b", mul "x*a",
affine "x*a+b", square "x*x+b", mod "x%a"; a in [2, C], b in [1, C], C = ``operand_max``) and
shows ``examples`` values of it at distinct inputs in [0, ``shown_max``] (at most 9); a problem
is kept only when no other function of the configured forms gives the same shown values, so the
answer is determined.
The record carries ``tests`` metadata for the ``code_tests`` reward (rewards/code_tests.py):
``hidden_tests`` inputs in [0, 99] that the prompt does not show, as {"stdin": "42\\n", "stdout":
"46\\n"}, a pure function of the prompt. The reward runs the expression in the sandbox through a
``harness`` ("x = int(input())\\nprint({code})", configs/tiny_code.yaml). With
``general_demonstrations`` below 1, that share of the records has the expression as its warm-start
``target`` and the rest a lookup of the shown values ("{3:7,5:9}[x]"): right on the prompt, a
KeyError on every hidden input, as a model that special-cases the examples writes; RL then has a
habit to unlearn, as the agentic task's answers without the tool. The task's own verifier
(the ``synthetic`` reward) never runs the model's text: it parses it with ``ast`` (integers, x,
+ - * // % and parentheses only) and compares it with the answer on every input in [0, 99].

The reasoning tasks (retry, pad, pairs) exist to show the GRPO family's length and entropy
dynamics (docs/reproductions.md), which a 3-token answer cannot. They always box their answer
(``response_format`` is ignored) and carry ``difficulty`` (the operands' digits) in their
records. Their warm-start ``target`` is a trace drawn per record from the generator's stream:

* ``retry``: one or more attempts, each the sum's digits least significant first (the order a
  column addition produces them, which a small model learns), followed by a self-check; a failed
  check starts another attempt, at most ``attempts``; the last attempt is boxed most significant
  first: ``"415 chk:no 504 chk:ok \\boxed{405}"``. Each attempt of the trace is wrong with
  probability ``retry_noise`` (one digit off by one, a carry slip), and its check says ``no``
  exactly when it is wrong except for a ``check_miss`` share of wrong attempts passed as ``ok``.
  A model warm-started on these samples slips about as often as the traces, and its check, a
  judgement of text it can see, is better than its attempts; the longest responses are those
  that ran out of attempts, whose last attempt is boxed whatever its check says. Length therefore
  goes with wrongness inside a group (the warm-started tiny model's in-group wrong - correct gap:
  0.4 to 3 tokens), which is what GRPO's per-sample 1/|o| weighting acts on (Dr. GRPO
  arXiv:2503.20783 §3.1).
* ``pad``: the negative control: optional filler (``"."`` x k, k = 0 for half the records, else
  uniform in [1, ``pad_max``]) before one attempt and the boxed answer: ``"....504 \\boxed{405}"``.
  The filler is written before the sum is computed, so its length says nothing about correctness,
  until it reaches the response cap: a truncated response has no answer (docs/reproductions.md).
* ``pairs``: "sum 13=" asks for two non-negative integers adding up to 13, boxed as
  ``"\\boxed{6+7}"``: n + 1 correct answers, the warm start's split drawn uniformly, so the number of
  distinct correct answers in a group measures how much of its entropy the policy keeps.

A `mul` record also carries a `demonstration` for the multi-turn warm start
(agents/demonstrations.py): the conversation of a model that calls the calculator and states its
result, or (for 1 - ``tool_demonstrations`` of the records) one that answers at once.

Response formats (``response_format``): "plain", the answer then the end of the sequence ("19"
then EOS), the default because a tiny model learns it fastest; or "boxed" ("\\boxed{19}").
Verification extracts the answer by the format and compares it with the task's own rule: as
integers for add / count / modular, as exact digit strings for sort / reverse, as functions of x
for expr.

Splits are disjoint by construction: a prompt belongs to the held-out split when a stable hash
of (task, prompt) falls below ``heldout_fraction``, whatever the seed. Train records are drawn
with replacement (small problem spaces repeat); held-out records are unique, so held-out accuracy
counts distinct problems. Generation uses ``random.Random`` seeded with a string (hashed with
SHA-512 by Python), whose streams are stable across Python versions and platforms.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any, Callable, Literal

from megatron_rl.errors import ConfigError
from megatron_rl.rewards.expr_task import (EXPR_FORMS, SHOWN_MAX, TEST_INPUTS, expr_lookup, expr_problem, expr_tests,
                                             same_function)
from megatron_rl.rewards.math_answer import extract_boxed

__all__ = ["TASKS", "SPLITS", "REASONING_TASKS", "TaskConfig", "SyntheticTask", "make_task", "response_mode",
           "verify_synthetic"]

ResponseFormat = Literal["plain", "boxed"]
Split = Literal["train", "heldout"]
SPLITS = ("train", "heldout")
RESPONSE_FORMATS = ("plain", "boxed")


@dataclass
class TaskConfig:
    """One synthetic task and its difficulty; each task reads only the knobs it uses."""

    task: Literal["add", "sort", "reverse", "count", "modular", "mul", "expr", "retry", "pad", "pairs"] = "add"
    # add / modular: operands are drawn uniformly from [0, 10**digits - 1] ...
    digits: int = 2
    # ... or from [0, max_operand] when set: a finer difficulty knob than whole digits.
    max_operand: int | None = None
    # sort / reverse: digits in the list; count: characters in the string.
    length: int = 4
    # count: the alphabet of the string (one symbol of it is counted).
    symbols: str = "abc"
    # modular: the modulus of a*b % m.
    modulus: int = 7
    # mul: the share of records whose demonstration calls the calculator; the others answer at
    # once (with the product, which a small model cannot compute). Below 1, a warm-started model
    # sometimes skips the tool, and RL can show it learning to call it.
    tool_demonstrations: float = 1.0
    # expr: the forms the hidden function is drawn from (comma-separated names of EXPR_FORMS), the
    # values shown in the prompt, and the test cases the reward runs (inputs the prompt does not show).
    forms: str = "add,mul"
    examples: int = 2
    hidden_tests: int = 4
    # expr: shown inputs are drawn from [0, shown_max]; small ranges make the constants easy to
    # read off (f(0) = b, f(1) = a), larger ones need subtraction or division.
    shown_max: int = 9
    # expr: the share of records whose warm-start target is the general expression; the others'
    # is a lookup of the shown values ("{3:7,5:9}[x]"), which fits the prompt and fails every
    # hidden test. Below 1, a warm-started model sometimes special-cases the examples, and RL can
    # show it learning to write the rule instead (the hidden tests pay only for that).
    general_demonstrations: float = 1.0
    # retry / pad: operand digits are drawn uniformly from [min_digits, digits] per problem (both
    # operands the same count; its `difficulty`), a mix that keeps a small model's accuracy in the
    # middle for many steps.
    min_digits: int = 1
    # retry: attempts per trace at most (the last is boxed whatever its check says), the chance
    # that a trace's attempt is wrong, and the share of wrong attempts its check passes as ok.
    attempts: int = 3
    retry_noise: float = 0.3
    check_miss: float = 0.1
    # pad: the longest filler of a trace (half the traces have none).
    pad_max: int = 24
    response_format: ResponseFormat = "plain"
    # Share of the problem space reserved for held-out evaluation (by hash of the prompt).
    heldout_fraction: float = 0.1

    def validate(self, where: str = "task") -> TaskConfig:
        if self.task not in TASKS:
            raise ConfigError(f"{where}.task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if not 1 <= self.digits <= 9:
            raise ConfigError(f"{where}.digits must be in [1, 9], got {self.digits}")
        if self.max_operand is not None and self.max_operand < 1:
            raise ConfigError(f"{where}.max_operand must be >= 1 (or null), got {self.max_operand}")
        if not 1 <= self.length <= 64:
            raise ConfigError(f"{where}.length must be in [1, 64], got {self.length}")
        if not self.symbols or len(set(self.symbols)) != len(self.symbols) or not self.symbols.isalpha() \
                or not self.symbols.islower():
            raise ConfigError(f"{where}.symbols must be distinct lowercase letters, got {self.symbols!r}")
        if not 0.0 <= self.general_demonstrations <= 1.0:
            raise ConfigError(f"{where}.general_demonstrations must be in [0, 1], got {self.general_demonstrations}")
        if not 0.0 <= self.tool_demonstrations <= 1.0:
            raise ConfigError(f"{where}.tool_demonstrations must be in [0, 1], got {self.tool_demonstrations}")
        self._validate_expr(where)
        if not 1 <= self.min_digits <= self.digits:
            raise ConfigError(f"{where}.min_digits must be in [1, digits = {self.digits}], got {self.min_digits}")
        if not 1 <= self.attempts <= 9:
            raise ConfigError(f"{where}.attempts must be in [1, 9], got {self.attempts}")
        for name in ("retry_noise", "check_miss"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{where}.{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0 <= self.pad_max <= 256:
            raise ConfigError(f"{where}.pad_max must be in [0, 256], got {self.pad_max}")
        if self.modulus < 2:
            raise ConfigError(f"{where}.modulus must be >= 2, got {self.modulus}")
        if self.response_format not in RESPONSE_FORMATS:
            raise ConfigError(
                f"{where}.response_format must be one of {', '.join(RESPONSE_FORMATS)}, got {self.response_format!r}"
            )
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ConfigError(f"{where}.heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        return self

    def _validate_expr(self, where: str) -> None:
        unknown = [name for name in self.form_names if name not in EXPR_FORMS]
        if not self.form_names or unknown:
            raise ConfigError(f"{where}.forms must be a comma-separated list of {', '.join(EXPR_FORMS)}, "
                              f"got {self.forms!r}")
        if not 1 <= self.shown_max <= SHOWN_MAX:
            raise ConfigError(f"{where}.shown_max must be in [1, {SHOWN_MAX}], got {self.shown_max}")
        if not 1 <= self.examples <= self.shown_max + 1:
            raise ConfigError(f"{where}.examples must be in [1, shown_max + 1 = {self.shown_max + 1}] (distinct "
                              f"inputs in [0, shown_max]), got {self.examples}")
        if not 1 <= self.hidden_tests <= len(TEST_INPUTS) - SHOWN_MAX - 1:
            raise ConfigError(f"{where}.hidden_tests must be in [1, {len(TEST_INPUTS) - SHOWN_MAX - 1}], "
                              f"got {self.hidden_tests}")

    @property
    def form_names(self) -> tuple[str, ...]:
        return tuple(name.strip() for name in self.forms.split(",") if name.strip())

    @property
    def answer_format(self) -> ResponseFormat:
        """How responses state the answer: the reasoning tasks always box it."""
        return "boxed" if self.task in REASONING_TASKS else self.response_format

    @property
    def operand_max(self) -> int:
        return self.max_operand if self.max_operand is not None else 10**self.digits - 1


# --------------------------------------------------------------------------- the tasks
# Each generator draws one problem: (prompt, canonical answer). Each checker compares an
# extracted candidate with the canonical answer.


def _add(rng: random.Random, config: TaskConfig) -> tuple[str, str]:
    a, b = rng.randint(0, config.operand_max), rng.randint(0, config.operand_max)
    return f"{a}+{b}=", str(a + b)


def _digit_list(rng: random.Random, config: TaskConfig) -> list[str]:
    return [str(rng.randrange(10)) for _ in range(config.length)]


def _sort(rng: random.Random, config: TaskConfig) -> tuple[str, str]:
    digits = _digit_list(rng, config)
    return f"sort {''.join(digits)}=", "".join(sorted(digits))


def _reverse(rng: random.Random, config: TaskConfig) -> tuple[str, str]:
    digits = _digit_list(rng, config)
    return f"rev {''.join(digits)}=", "".join(reversed(digits))


def _count(rng: random.Random, config: TaskConfig) -> tuple[str, str]:
    text = "".join(rng.choice(config.symbols) for _ in range(config.length))
    symbol = rng.choice(config.symbols)
    return f"count {symbol} in {text}=", str(text.count(symbol))


def _modular(rng: random.Random, config: TaskConfig) -> tuple[str, str]:
    a, b = rng.randint(0, config.operand_max), rng.randint(0, config.operand_max)
    return f"{a}*{b}%{config.modulus}=", str(a * b % config.modulus)


def _mul(rng: random.Random, config: TaskConfig) -> tuple[str, str]:
    # `digits`-digit operands (both exactly that long), or [0, max_operand] when that is set
    low = 0 if config.max_operand is not None else 10 ** (config.digits - 1)
    a, b = rng.randint(low, config.operand_max), rng.randint(low, config.operand_max)
    return f"{a}*{b}=", str(a * b)


_INTEGER = re.compile(r"[+-]?\d{1,64}")


def _same_integer(candidate: str, answer: str) -> bool:
    return _INTEGER.fullmatch(candidate) is not None and int(candidate) == int(answer)


def _same_string(candidate: str, answer: str) -> bool:
    return candidate == answer


# --------------------------------------------------------------------------- the reasoning tasks
# retry / pad / pairs: the problems are drawn here, the traces a warm start imitates in
# SyntheticTask.record (they need the generator's stream, a trace per record).
REASONING_TASKS = ("retry", "pad", "pairs")
CHECK_OK, CHECK_NO = " chk:ok", " chk:no"
PAD = "."


def _column_sum(rng: random.Random, config: TaskConfig) -> tuple[str, str]:
    digits = rng.randint(config.min_digits, config.digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    a, b = rng.randint(low, 10**digits - 1), rng.randint(low, 10**digits - 1)
    return f"{a}+{b}=", str(a + b)


def _pairs(rng: random.Random, config: TaskConfig) -> tuple[str, str]:
    n = rng.randint(1, config.operand_max)
    return f"sum {n}=", str(n)


def _slip(answer: str, rng: random.Random) -> str:
    """The answer with one digit off by one (a carry slip); the leading digit never becomes 0."""
    digits = list(answer)
    index = rng.randrange(len(digits))
    value = int(digits[index])
    choices = [v for v in (value - 1, value + 1) if 0 <= v <= 9 and not (index == 0 and v == 0 and len(digits) > 1)]
    digits[index] = str(rng.choice(choices))
    return "".join(digits)


def retry_trace(answer: str, rng: random.Random, config: TaskConfig) -> str:
    """A check-and-retry trace for the sum `answer` (see the module docstring)."""
    parts, attempt = [], answer
    for _ in range(config.attempts):
        wrong = rng.random() < config.retry_noise
        attempt = _slip(answer, rng) if wrong else answer
        passed = not wrong or rng.random() < config.check_miss
        parts.append(attempt[::-1] + (CHECK_OK if passed else CHECK_NO))
        if passed:
            break
    return " ".join(parts) + f" \\boxed{{{attempt}}}"


def pad_trace(answer: str, rng: random.Random, config: TaskConfig) -> str:
    filler = 0 if config.pad_max == 0 or rng.random() < 0.5 else rng.randint(1, config.pad_max)
    return PAD * filler + f"{answer[::-1]} \\boxed{{{answer}}}"


def pairs_trace(answer: str, rng: random.Random, config: TaskConfig) -> str:
    first = rng.randint(0, int(answer))
    return f"\\boxed{{{first}+{int(answer) - first}}}"


TRACES = {"retry": retry_trace, "pad": pad_trace, "pairs": pairs_trace}
_PAIR = re.compile(r"(\d{1,9})\+(\d{1,9})")


def _pair_sums_to(candidate: str, answer: str) -> bool:
    match = _PAIR.fullmatch(candidate)
    return match is not None and int(match[1]) + int(match[2]) == int(answer)


def response_mode(task: str, response: str) -> str | None:
    """The kind of response a reasoning task's sample is, for the per-step mode shares: retry
    "attempts_<k>" (k self-checks written) or "no_answer"; pad "padded" / "unpadded"; None for
    the other tasks."""
    if task == "retry":
        if extract_boxed(response) is None:
            return "no_answer"
        return f"attempts_{response.count(' chk:')}"
    if task == "pad":
        return "padded" if response.startswith(PAD) else "unpadded"
    return None


Generator = Callable[[random.Random, TaskConfig], tuple[str, str]]
Checker = Callable[[str, str], bool]

TASKS: dict[str, tuple[Generator, Checker]] = {
    "add": (_add, _same_integer),
    "sort": (_sort, _same_string),
    "reverse": (_reverse, _same_string),
    "count": (_count, _same_integer),
    "modular": (_modular, _same_integer),
    "mul": (_mul, _same_integer),
    "expr": (expr_problem, same_function),
    "retry": (_column_sum, _same_integer),
    "pad": (_column_sum, _same_integer),
    "pairs": (_pairs, _pair_sums_to),
}


# --------------------------------------------------------------------------- task objects


def _heldout_bucket(task: str, prompt: str) -> float:
    """A stable pseudo-uniform number in [0, 1) for a prompt (not Python's salted hash())."""
    digest = hashlib.blake2b(f"{task}\n{prompt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class SyntheticTask:
    """A configured task: generates records and verifies responses."""

    def __init__(self, config: TaskConfig):
        self.config = config.validate()
        self.name = config.task
        self._generate_one, self._check = TASKS[config.task]

    def split_of(self, prompt: str) -> Split:
        return "heldout" if _heldout_bucket(self.name, prompt) < self.config.heldout_fraction else "train"

    def target(self, answer: str) -> str:
        """The reference response for an answer (what a supervised warm start trains on)."""
        return f"\\boxed{{{answer}}}" if self.config.answer_format == "boxed" else answer

    def extract(self, response: str) -> str | None:
        if self.config.answer_format == "boxed":
            boxed = extract_boxed(response)
            return None if boxed is None else boxed.strip()
        return response.strip()

    def verify(self, response: str, answer: str) -> float:
        """1.0 when the response states the answer in the task's format, else 0.0."""
        candidate = self.extract(response)
        return float(candidate is not None and self._check(candidate, answer))

    def record(self, prompt: str, answer: str, rng: random.Random | None = None) -> dict[str, Any]:
        """A record of a problem; `rng`: the generator's stream, which draws the reasoning tasks'
        traces (None: a stream of the prompt's own)."""
        record = {
            "prompt": prompt,
            "answer": answer,
            "task": self.name,
            "response_format": self.config.answer_format,
            "target": self.target(answer),
        }
        if self.name in TRACES:
            rng = rng or random.Random(f"megatron_rl.synthetic:trace:{prompt}")
            record["target"] = TRACES[self.name](answer, rng, self.config)
            if self.name != "pairs":
                record["difficulty"] = len(prompt.split("+")[0])
        if self.name == "expr":
            record["tests"] = expr_tests(prompt, answer, self.config)
            # which records demonstrate a lookup: a stable function of the prompt (as the split is)
            if _heldout_bucket("general-demonstration", prompt) >= self.config.general_demonstrations:
                record["target"] = self.target(expr_lookup(prompt))
        if self.name == "mul":
            record["demonstration"] = [{"role": "assistant", "content": self.target(answer)}]
            # which records call the tool: a stable function of the prompt (as the split is)
            if _heldout_bucket("tool-demonstration", prompt) < self.config.tool_demonstrations:
                record["demonstration"] = [
                    {"role": "assistant", "content": "",
                     "tool_calls": [{"name": "calculator", "arguments": {"expression": prompt.rstrip("=")}}]},
                    {"role": "tool", "content": answer},
                    {"role": "assistant", "content": self.target(answer)},
                ]
        return record

    def generate(self, n: int, *, seed: int, split: Split) -> list[dict[str, Any]]:
        """``n`` records of one split, a pure function of (config, seed, split).

        Train draws with replacement; held-out draws distinct prompts and raises ConfigError when
        the split's share of the problem space is too small for ``n``.
        """
        if split not in SPLITS:
            raise ConfigError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        if n < 0:
            raise ConfigError(f"number of {split} records must be >= 0, got {n}")
        rng = random.Random(f"megatron_rl.synthetic:{self.name}:{split}:{seed}")
        records: list[dict[str, Any]] = []
        seen: set[str] = set()
        # Generous: the held-out split holds ~heldout_fraction of the draws, minus repeats.
        budget = 1000 + int(50 * n / min(self.config.heldout_fraction, 1 - self.config.heldout_fraction))
        for _ in range(budget):
            if len(records) == n:
                return records
            prompt, answer = self._generate_one(rng, self.config)
            if self.split_of(prompt) != split or (split == "heldout" and prompt in seen):
                continue
            seen.add(prompt)
            records.append(self.record(prompt, answer, rng))
        if len(records) == n:
            return records
        raise ConfigError(
            f"task {self.name!r}: found only {len(records)} distinct {split} prompts of the {n} asked; "
            "the problem space is too small (raise digits/length/max_operand or heldout_fraction, "
            "or ask for fewer)"
        )


def make_task(config: TaskConfig | None = None, **overrides: Any) -> SyntheticTask:
    """``make_task(TaskConfig(task="sort", length=5))`` or ``make_task(task="sort", length=5)``."""
    if config is None:
        fields = TaskConfig.__dataclass_fields__
        unknown = sorted(set(overrides) - set(fields))
        if unknown:
            raise ConfigError(f"unknown synthetic task setting {unknown[0]!r}; known: {', '.join(fields)}")
        config = TaskConfig(**overrides)
    elif overrides:
        raise ConfigError("pass either a TaskConfig or keyword settings, not both")
    return SyntheticTask(config)


def verify_synthetic(response: str, answer: str, *, task: str, response_format: str = "plain") -> float:
    """Verify a response to a synthetic record from its metadata alone (difficulty is irrelevant)."""
    return make_task(task=task, response_format=response_format).verify(response, answer)
