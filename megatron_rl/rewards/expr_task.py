"""The `expr` synthetic task (the code task): a hidden one-line function of x, shown at a few
inputs, answered with a Python expression and checked on hidden inputs without running it.

Its record layout, knobs and demonstrations are described with the other tasks in
rewards/synthetic.py; this module holds the problem generator, the ast-walking evaluator the
verifier uses (no eval), and the hidden test cases the `code_tests` reward runs in the sandbox.
"""

from __future__ import annotations

import ast
import functools
import operator
import random
import re
from typing import Protocol

from megatron_rl.errors import ConfigError


class ExprSettings(Protocol):
    """The TaskConfig fields this task reads (synthetic.py's TaskConfig has them; a Protocol keeps
    this module from importing the one that imports it)."""

    forms: str
    form_names: tuple[str, ...]
    operand_max: int
    shown_max: int
    examples: int
    hidden_tests: int

# The hidden function's forms, with their constants: a (a factor or modulus) in [2, C], b (an
# offset) in [1, C]. a >= 2 and b >= 1 so that no two (form, constants) give the same function.
EXPR_FORMS = {
    "add": "x+{b}",
    "sub": "x-{b}",
    "mul": "x*{a}",
    "affine": "x*{a}+{b}",
    "square": "x*x+{b}",
    "mod": "x%{a}",
}
SHOWN_MAX = 9               # inputs shown in the prompt: single digits, short prompts
TEST_INPUTS = range(100)    # inputs the tests and the verifier use
MAX_EXPR_CHARS = 200        # longer responses are wrong without parsing (bounds the verifier's work)
_EXPR_DRAWS = 1000

_EXPR_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def _expr_node(node: ast.AST, x: int) -> int:
    """Value of an expression tree at x; ValueError for anything but integers, x, + - * // % ()."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name) and node.id == "x":
        return x
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _expr_node(node.operand, x)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _EXPR_OPS:
        return _EXPR_OPS[type(node.op)](_expr_node(node.left, x), _expr_node(node.right, x))
    raise ValueError(f"not allowed in an expr answer: {type(node).__name__}")


def expr_values(expression: str, inputs) -> list[int] | None:
    """The expression's values at `inputs`, computed without running it (ast walk, no eval); None
    when it is not an arithmetic expression in x or fails (division by zero, too long, too deep)."""
    if len(expression) > MAX_EXPR_CHARS:
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        return [_expr_node(tree.body, x) for x in inputs]
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return None


@functools.lru_cache(maxsize=16)
def _expr_table(forms: tuple[str, ...], limit: int) -> dict[tuple[int, int], list[str]]:
    """Every candidate function (as its canonical expression) by (shown input, value): the
    candidates that agree with one shown example, from which a prompt's ambiguity is read."""
    table: dict[tuple[int, int], list[str]] = {}
    for form in forms:
        template = EXPR_FORMS[form]
        factors = range(2, limit + 1) if "{a}" in template else (None,)
        offsets = range(1, limit + 1) if "{b}" in template else (None,)
        for a in factors:
            for b in offsets:
                expression = template.format(a=a, b=b)
                for x, y in enumerate(expr_values(expression, range(SHOWN_MAX + 1))):
                    table.setdefault((x, y), []).append(expression)
    return table


def _expr_prompt(pairs: list[tuple[int, int]]) -> str:
    return " ".join(f"f({x})={y}" for x, y in pairs) + " f(x)="


def expr_problem(rng: random.Random, config: ExprSettings) -> tuple[str, str]:
    # Draw a function and its shown inputs until the shown values determine it within the forms.
    forms, limit = config.form_names, max(2, config.operand_max)
    table = _expr_table(forms, limit)
    for _ in range(_EXPR_DRAWS):
        form = EXPR_FORMS[rng.choice(forms)]
        answer = form.format(a=rng.randint(2, limit), b=rng.randint(1, limit))
        inputs = rng.sample(range(config.shown_max + 1), config.examples)
        pairs = list(zip(inputs, expr_values(answer, inputs)))
        fitting = set(table[pairs[0]]).intersection(*(table[pair] for pair in pairs[1:]))
        if fitting == {answer}:
            return _expr_prompt(pairs), answer
    raise ConfigError(f"task 'expr': no problem in {_EXPR_DRAWS} draws whose {config.examples} shown examples "
                      f"determine the function among the forms {config.forms!r}; raise examples")


def expr_tests(prompt: str, answer: str, config: ExprSettings) -> list[dict[str, str]]:
    """The record's test cases: `hidden_tests` inputs the prompt does not show, a pure function of
    the prompt, as the code_tests reward reads them (stdin, stdout)."""
    shown = {int(x) for x in re.findall(r"f\((\d+)\)=", prompt)}
    hidden = [x for x in TEST_INPUTS if x not in shown]
    inputs = random.Random(f"megatron_rl.synthetic:expr-tests:{prompt}").sample(hidden, config.hidden_tests)
    return [{"stdin": f"{x}\n", "stdout": f"{y}\n"} for x, y in zip(inputs, expr_values(answer, inputs))]


def expr_lookup(prompt: str) -> str:
    """A response that special-cases the shown examples: a dict of them indexed by x. It is right
    on the prompt's inputs and raises KeyError on every other (the hidden tests')."""
    pairs = re.findall(r"f\((\d+)\)=(-?\d+)", prompt)
    return "{" + ",".join(f"{x}:{y}" for x, y in pairs) + "}[x]"


def same_function(candidate: str, answer: str) -> bool:
    values = expr_values(candidate, TEST_INPUTS)
    return values is not None and values == expr_values(answer, TEST_INPUTS)
