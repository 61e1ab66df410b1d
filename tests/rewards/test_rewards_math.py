"""Math answers: extraction, the sympy-free fast path, math-verify, and the reward function."""

from __future__ import annotations

import time

import pytest

from megatron_rl.rewards.math_answer import (answers_match, extract_answer, extract_boxed, fast_verdict,
                                             math_fast_path, math_reward, math_verify_available, normalize_answer,
                                             parse_number, reference_answer)

needs_math_verify = pytest.mark.skipif(not math_verify_available(), reason="math-verify is not installed")


@pytest.mark.parametrize(
    "text, want",
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces
        (r"\boxed{x^{2}+\sqrt{y_{1}}}", r"x^{2}+\sqrt{y_{1}}"),
        (r"first \boxed{1}, then \boxed{2}", "2"),  # last one wins
        (r"\boxed{\boxed{7}}", "7"),  # nested boxes unwrap
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces are literal
        (r"\boxed{3} and then \boxed{4", "3"),  # an unfinished last box (cut off) does not count
        (r"\boxed {5}", "5"),
        (r"\fbox{6}", "6"),
        (r"\boxed{}", ""),
        ("no box here", None),
        ("}}} { \\boxed", None),
    ],
)
def test_extract_boxed(text, want):
    assert extract_boxed(text) == want


@pytest.mark.parametrize(
    "text, want",
    [
        (r"The answer is \boxed{12}. Answer: 13", "12"),  # boxed beats the fallbacks
        ("Work... #### 1,000", "1,000"),
        ("#### 3\nmore text\n#### 4", "4"),
        ("The answer is 42.", "42"),
        ("Final Answer: $\\frac{3}{4}$", "$\\frac{3}{4}$"),
        ("19", "19"),  # a bare number is its own answer
        (" $0.5$ ", "0.5".join(["$", "$"])),
        ("I think it is nineteen", None),
    ],
)
def test_extract_answer_fallbacks(text, want):
    assert extract_answer(text) == want


def test_require_boxed_disables_fallbacks():
    assert extract_answer("Answer: 5", require_boxed=True) is None
    assert extract_answer("19", require_boxed=True) is None
    assert extract_answer(r"\boxed{5}", require_boxed=True) == "5"


def test_reference_answer_unwraps_solutions():
    assert reference_answer("Natalia sold 48/2 = 24 clips... #### 72") == "72"
    assert reference_answer(r"so $\boxed{\frac{1}{2}}$") == r"\frac{1}{2}"
    assert reference_answer(" 5 ") == "5"


@pytest.mark.parametrize(
    "predicted, reference",
    [
        ("0.5", r"\frac{1}{2}"),
        (r"\dfrac{1}{2}", "1/2"),
        (r"\frac12", "0.5"),
        ("1,000", "1000"),
        ("1,234,567.5", "1234567.5"),
        ("19.0", "19"),
        ("$19$", "19"),
        (r"\$19", "19"),
        ("x = 3", "3"),
        (r"-\frac{3}{4}", "-0.75"),
        (r"10\%", "10"),
        (r"30^\circ", "30"),
        (r"\text{5}", "5"),
        ("0.333333", "1/3"),  # equal after rounding to 6 decimals (as math-verify does)
        (r"\left(1,2\right)", "(1,2)"),
    ],
)
def test_fast_path_accepts_equivalent_forms(predicted, reference):
    assert fast_verdict(predicted, reference) is True
    assert answers_match(predicted, reference, use_math_verify=False)


@pytest.mark.parametrize(
    "predicted, reference",
    [("3", "4"), ("0.5", r"\frac{1}{3}"), ("1,001", "1000"), ("-2", "2"), ("0.33", "1/3"), ("1/0", "1")],
)
def test_fast_path_rejects_different_numbers(predicted, reference):
    assert not answers_match(predicted, reference, use_math_verify=False)


def test_fast_path_leaves_symbolic_answers_undecided():
    assert fast_verdict(r"\sqrt{2}", r"\sqrt 2") is None
    assert fast_verdict("2x+1", "1+2x") is None
    assert not answers_match(r"\sqrt{2}", r"\sqrt 2", use_math_verify=False)  # without sympy: wrong


def test_parse_number():
    assert parse_number("1,000") == 1000
    assert parse_number("-.5") == parse_number("-0.5")
    assert parse_number("7/8") * 8 == 7
    assert parse_number(r"\frac{-3}{6}") * 2 == -1
    assert parse_number("1" * 65) is None  # too long for the fast path
    assert parse_number("1e5") is None  # exponents go to sympy
    assert parse_number("abc") is None


def test_normalize_answer():
    assert normalize_answer(r"$\left( 1, 2 \right)$.") == "(1,2)"
    assert normalize_answer(r"\[ \dfrac{1}{2} \]") == r"\frac{1}{2}"


@needs_math_verify
@pytest.mark.parametrize(
    "predicted, reference, want",
    [
        (r"\sqrt{2}", r"\sqrt 2", True),
        ("2x+1", "1+2x", True),
        (r"\frac{\pi}{2}", r"\pi/2", True),
        (r"\sqrt{3}", r"\sqrt{2}", False),
        ("x^2", "x^3", False),
    ],
)
def test_math_verify_decides_symbolic_answers(predicted, reference, want):
    assert answers_match(predicted, reference) is want


def test_math_reward():
    assert math_reward("q", r"... so \boxed{\frac{1}{2}}", "0.5") == 1.0
    assert math_reward("q", r"\boxed{3}", "#### 4") == 0.0
    assert math_reward("q", "The answer is 1,000.", "1000") == 1.0
    assert math_reward("q", "no idea", "5") == 0.0
    assert math_reward("q", "Answer: 5", "5", require_boxed=True) == 0.0
    with pytest.raises(ValueError, match="reference answer"):
        math_reward("q", "5", None)


def test_math_fast_path_returns_none_only_when_undecided():
    assert math_fast_path("q", r"\boxed{2}", "2") == 1.0
    assert math_fast_path("q", r"\boxed{3}", "2") == 0.0
    assert math_fast_path("q", "nothing", "2") == 0.0
    assert math_fast_path("q", r"\boxed{\sqrt{2}}", r"\sqrt 2") is None


def test_extraction_is_linear_on_adversarial_text():
    # Many unclosed boxes and braces: a quadratic scan would take seconds here.
    text = r"\boxed{" * 20000 + "{" * 20000 + "answer is 1 " * 2000
    start = time.perf_counter()
    assert extract_boxed(text) is None
    extract_answer(text)
    assert time.perf_counter() - start < 1.0
