"""Math answers: extract the final answer from a response and check it against the reference.

Extraction (``extract_answer``): the last complete ``\\boxed{...}`` (or ``\\fbox{...}``), with
nested and escaped braces handled; without one, the text after the last ``####`` (GSM8K style) or
after the last "answer is" / "answer:" (case-insensitive), up to the end of that line; or the
whole response when it is nothing but a number. ``require_boxed=True`` disables the fallbacks.
An unfinished last ``\\boxed{`` (the response was cut off) does not count; the last complete one
does.

Equivalence (``answers_match``) runs two stages:

1. A fast path in pure Python (``fast_verdict``), which decides the common cases without sympy:
   after light LaTeX normalization (``$...$``, ``\\left``/``\\right``, spacing commands,
   ``\\text{}``, ``\\dfrac``, degrees, percent signs, a leading ``x =``), two plain numbers
   (integers, "1,000", decimals, "a/b", ``\\frac{a}{b}``) are compared exactly after rounding to
   6 decimals (the rule math-verify uses), and identical normalized strings match.
2. Otherwise, when the ``math-verify`` package (Hugging Face, pip ``math-verify``) is installed,
   its sympy-based ``verify`` decides (``\\sqrt 2`` vs ``\\sqrt{2}``, intervals, sets,
   expressions). Without it the answer is judged by the fast path alone: anything it cannot
   decide counts as wrong. math-verify's own signal-based timeouts are turned off (they only
   work in a main thread): the scorer bounds the time instead, by running this stage in a worker
   process with a timeout.

Every step of the fast path is linear in the text length and numbers are length-capped, so it is
safe to run inline in the trainer process.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from fractions import Fraction
from typing import Any

__all__ = [
    "BOXED_OPEN",
    "extract_boxed",
    "closing_brace",
    "extract_answer",
    "normalize_answer",
    "parse_number",
    "fast_verdict",
    "answers_match",
    "math_reward",
    "math_fast_path",
    "math_verify_available",
    "prepare_math_verify",
]

BOXED_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
# Last "#### X" and "answer is X" / "answer: X" lines; [^\n] keeps each match on one line.
_HASHES = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS = re.compile(r"answer\s*(?:is\s*:?|:)\s*([^\n]*)", re.IGNORECASE)

# A number longer than this is not decided by the fast path (Fraction of a huge string is slow).
_MAX_NUMBER_CHARS = 64
_ROUND_DIGITS = 6


def extract_boxed(text: str) -> str | None:
    """Content of the ``\\boxed{...}`` that closes last, or None when there is no complete one.

    One left-to-right pass with a brace stack, so the cost is linear even for adversarial text.
    ``\\{`` and ``\\}`` are literal braces (LaTeX set notation), not grouping. For nested boxes
    (``\\boxed{\\boxed{1}}``) the outer one closes last; its content is unwrapped again.
    """
    best: str | None = None
    stack: list[tuple[int, bool]] = []  # (content start, opened by \boxed) per open brace
    i, n = 0, len(text)
    while i < n:
        char = text[i]
        if char == "\\":
            opener = BOXED_OPEN.match(text, i)
            if opener:
                stack.append((opener.end(), True))
                i = opener.end()
                continue
            i += 2 if i + 1 < n and text[i + 1] in "{}\\" else 1
            continue
        if char == "{":
            stack.append((i + 1, False))
        elif char == "}" and stack:
            start, boxed = stack.pop()
            if boxed:
                best = text[start:i]
        i += 1
    while best is not None:  # \boxed{\boxed{x}}: unwrap to x
        inner = best.strip()
        opener = BOXED_OPEN.match(inner)
        if opener is None or closing_brace(inner, opener.end()) != len(inner) - 1:
            break
        best = inner[opener.end() : -1]
    return best


def closing_brace(text: str, start: int) -> int | None:
    """Index of the brace closing the group whose content starts at ``start`` (None if unclosed)."""
    depth, i = 1, start
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i
        i += 1
    return None


def extract_answer(text: str, *, require_boxed: bool = False) -> str | None:
    """The final answer in a response (see the module docstring), stripped; None if none."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if require_boxed:
        return None
    for pattern in (_HASHES, _ANSWER_IS):
        last = None
        for last in pattern.finditer(text):
            pass
        if last is not None:
            found = last.group(1).strip().rstrip(".").strip()
            return found or None
    # A response that is nothing but a number ("19", "$0.5$") is its own answer.
    if len(text) <= 2 * _MAX_NUMBER_CHARS and parse_number(normalize_answer(text)) is not None:
        return text.strip()
    return None


def reference_answer(answer: str) -> str:
    """The answer inside a reference that is itself a solution (boxed, or GSM8K "#### X")."""
    boxed = extract_boxed(answer)
    if boxed is not None:
        return boxed.strip()
    hashes = None
    for hashes in _HASHES.finditer(answer):
        pass
    return hashes.group(1).strip() if hashes else answer.strip()


_STRIP_COMMANDS = re.compile(r"\\left|\\right|\\displaystyle|\\!|\\,|\\;|\\:|\\ |~")
_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_DEGREES = re.compile(r"\^\s*\{?\\circ\}?")
_ASSIGNMENT = re.compile(r"^[a-zA-Z]\s*=\s*(?=\S)")
_MATH_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def normalize_answer(text: str) -> str:
    """A canonical spelling of a short answer; only rewrites that never change its value."""
    s = text.strip()
    for left, right in _MATH_DELIMITERS:
        if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
            s = s[len(left) : len(s) - len(right)].strip()
            break
    s = s.replace("\\$", "").replace("$", "")
    s = _STRIP_COMMANDS.sub("", s)
    s = _TEXT_WRAPPERS.sub(r"\1", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _DEGREES.sub("", s)
    # MATH references write percentages both ways ("10\%" and "10"); graders accept either.
    s = s.replace("\\%", "").replace("%", "")
    s = _ASSIGNMENT.sub("", s)
    s = "".join(s.split())
    return s.rstrip(".")


_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)")
_SLASH = re.compile(r"([+-]?\d+)/(\d+)")
_FRAC = re.compile(r"([+-]?)\\frac\{([+-]?\d+)\}\{(\d+)\}|([+-]?)\\frac(\d)(\d)")


def parse_number(text: str) -> Fraction | None:
    """The exact value of a normalized plain number, or None if it is not one."""
    if len(text) > _MAX_NUMBER_CHARS:
        return None
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    if _DECIMAL.fullmatch(text):
        return Fraction(text)
    slash = _SLASH.fullmatch(text)
    if slash:
        numerator, denominator = int(slash.group(1)), int(slash.group(2))
        return Fraction(numerator, denominator) if denominator else None
    frac = _FRAC.fullmatch(text)
    if frac:
        sign, numerator, denominator = (frac.group(1), frac.group(2), frac.group(3)) if frac.group(2) else (
            frac.group(4), frac.group(5), frac.group(6))
        if int(denominator) == 0:
            return None
        value = Fraction(int(numerator), int(denominator))
        return -value if sign == "-" else value
    return None


def fast_verdict(predicted: str, reference: str) -> bool | None:
    """True/False when the fast path can decide, None when it cannot (needs sympy)."""
    pred, ref = normalize_answer(predicted), normalize_answer(reference)
    if pred == ref:
        return True
    pred_value, ref_value = parse_number(pred), parse_number(ref)
    if pred_value is not None and ref_value is not None:
        return round(pred_value, _ROUND_DIGITS) == round(ref_value, _ROUND_DIGITS)
    return None


def math_verify_available() -> bool:
    return importlib.util.find_spec("math_verify") is not None


def _math_verify_equal(predicted: str, reference: str) -> bool:
    import math_verify  # imported here: sympy costs ~0.4 s, only the undecided cases need it

    # Boxing both sides makes math-verify parse them as one LaTeX answer each. Timeouts are None:
    # its signal.alarm timeouts fail outside a main thread; the scorer's worker timeout applies.
    gold = math_verify.parse(f"\\boxed{{{reference}}}", parsing_timeout=None)
    pred = math_verify.parse(f"\\boxed{{{predicted}}}", parsing_timeout=None)
    if not gold or not pred:
        return False
    return bool(math_verify.verify(gold, pred, timeout_seconds=None))


def answers_match(predicted: str, reference: str, *, use_math_verify: bool = True) -> bool:
    """Whether a predicted answer equals the reference (fast path, then math-verify if present)."""
    verdict = fast_verdict(predicted, reference)
    if verdict is not None:
        return verdict
    if use_math_verify and math_verify_available():
        return _math_verify_equal(predicted, reference)
    return False


def math_fast_path(
    prompt: str, response: str, answer: str | None, *, require_boxed: bool = False, **metadata: Any
) -> float | None:
    """The math reward when the fast path decides it, else None (see ``RewardFunction``)."""
    if answer is None:
        raise ValueError("the math reward needs a reference answer; the dataset has none")
    predicted = extract_answer(response, require_boxed=require_boxed)
    if predicted is None:
        return 0.0
    verdict = fast_verdict(predicted, reference_answer(answer))
    return None if verdict is None else float(verdict)


def math_reward(
    prompt: str,
    response: str,
    answer: str | None,
    *,
    require_boxed: bool = False,
    use_math_verify: bool = True,
    **metadata: Any,
) -> float:
    """1.0 when the response's final answer equals the reference answer, else 0.0."""
    if answer is None:
        raise ValueError("the math reward needs a reference answer; the dataset has none")
    predicted = extract_answer(response, require_boxed=require_boxed)
    if predicted is None:
        return 0.0
    return float(answers_match(predicted, reference_answer(answer), use_math_verify=use_math_verify))


def prepare_math_verify() -> None:
    """Import math-verify and run it once (sympy's first parse is slow), if it is installed.

    math-verify logs a one-time warning that its timeouts are off; that is intended here (the
    scorer's worker timeout replaces them), so the warm-up call consumes it quietly.
    """
    if not math_verify_available():
        return
    loggers = [logging.getLogger(f"math_verify.{name}") for name in ("parser", "grader")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        _math_verify_equal("\\sqrt{4}", "2")
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
