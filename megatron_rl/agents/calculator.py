"""The built-in `calculator` tool (rollout.tools: ["calculator"]): exact rational arithmetic.

Numbers are integers and decimals, read as exact fractions (0.1 is 1/10, not a float); the
operators are + - * / // % ** (an integer exponent), unary + and -, and parentheses. The
expression is parsed with Python's `ast` and walked node by node: nothing is ever eval'd, and
any other syntax (names, calls, attributes, strings, comparisons...) is refused. Work is
bounded: exponents above 1000 and numbers of more than 10,000 digits are refused before they
are computed. Results are exact: an integer, or a reduced fraction "a/b", never a float.
"""

from __future__ import annotations

import ast
import math
import operator
from fractions import Fraction

MAX_EXPRESSION_CHARS = 2_000
MAX_EXPONENT = 1_000
MAX_DIGITS = 10_000
_LIMIT = 10 ** MAX_DIGITS  # the smallest number with more than MAX_DIGITS digits
_MAX_BITS = _LIMIT.bit_length()

ALLOWED = ("allowed: integers and decimals, + - * / // % ** (integer exponents up to 1000), "
           "unary + and -, parentheses")

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_REFUSED = {ast.Name: "names", ast.Call: "function calls", ast.Attribute: "attributes",
            ast.Subscript: "subscripts", ast.Compare: "comparisons", ast.BoolOp: "boolean operators",
            ast.Lambda: "lambdas", ast.IfExp: "conditional expressions", ast.List: "lists",
            ast.Tuple: "tuples", ast.Dict: "dicts", ast.Set: "sets", ast.JoinedStr: "strings",
            ast.NamedExpr: "assignments"}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message says why."""


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result as an integer or a fraction a/b.

    Args:
        expression: The expression, using numbers (integers or decimals), + - * / // % **, and
            parentheses, e.g. "(1/3 + 2**-1) * 6".
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string; {ALLOWED}")
    text = expression.strip()
    if not text:
        raise CalculatorError(f"empty expression; {ALLOWED}")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression too long ({len(text)} characters, at most {MAX_EXPRESSION_CHARS})")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"cannot parse {_short(text)} ({exc.msg}); {ALLOWED}") from None
    except (ValueError, RecursionError, MemoryError):
        raise CalculatorError(f"cannot parse {_short(text)}: too long or too deeply nested") from None
    try:
        value = _evaluate(tree.body, text)
    except RecursionError:
        raise CalculatorError("expression too deeply nested") from None
    return format_fraction(value)


def format_fraction(value: Fraction) -> str:
    """`value` as "n" when it is an integer, else "a/b" (reduced, the sign on a)."""
    if value.denominator == 1:
        return _int_text(value.numerator)
    return f"{_int_text(value.numerator)}/{_int_text(value.denominator)}"


def _evaluate(node: ast.AST, source: str) -> Fraction:
    if isinstance(node, ast.Constant):
        return _number(node, source)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand, source))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left = _evaluate(node.left, source)
        right = _evaluate(node.right, source)
        if isinstance(node.op, ast.Pow):
            result = _power(left, right)
        else:
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
                raise CalculatorError(f"division by zero in {_short(_segment(source, node))}")
            result = Fraction(_BINARY[type(node.op)](left, right))
        _check_size(result)
        return result
    shown = _short(_segment(source, node))
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        raise CalculatorError(f"the operator {type(node.op).__name__} is not allowed ({shown}); {ALLOWED}")
    what = _REFUSED.get(type(node), f"{type(node).__name__} expressions")
    raise CalculatorError(f"{what} are not allowed ({shown}); {ALLOWED}")


def _number(node: ast.Constant, source: str) -> Fraction:
    value = node.value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculatorError(f"only numbers are allowed, not {_short(_segment(source, node))}; {ALLOWED}")
    if isinstance(value, int):
        _check_size(Fraction(value))
        return Fraction(value)
    literal = _segment(source, node).replace("_", "")
    try:
        result = Fraction(literal)  # the decimal as written: "0.1" is exactly 1/10
    except (ValueError, ZeroDivisionError):
        raise CalculatorError(f"cannot read the number {_short(literal)}; {ALLOWED}") from None
    _check_size(result)
    return result


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError(f"the exponent {format_fraction(exponent)} is not an integer: the result would not "
                              f"be exact; {ALLOWED}")
    power = exponent.numerator
    if abs(power) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {_int_text(power)} too large (at most {MAX_EXPONENT} in absolute value)")
    if base == 0 and power < 0:
        raise CalculatorError("division by zero (0 raised to a negative power)")
    bits = max(base.numerator.bit_length(), base.denominator.bit_length())
    if abs(power) > 1 and (bits - 1) * abs(power) > _MAX_BITS:
        raise CalculatorError(f"result too large (more than {MAX_DIGITS} digits)")
    result = base ** power
    _check_size(result)
    return result


def _check_size(value: Fraction) -> None:
    if abs(value.numerator) >= _LIMIT or value.denominator >= _LIMIT:
        raise CalculatorError(f"result too large (more than {MAX_DIGITS} digits)")


def _int_text(number: int) -> str:
    """str(number), also past Python's 4300-digit int-to-str limit (results go up to MAX_DIGITS)."""
    if number < 0:
        return "-" + _int_text(-number)
    if number.bit_length() < 10_000:  # under ~3000 digits: plain str is allowed
        return str(number)
    half = int(number.bit_length() * math.log10(2)) // 2
    high, low = divmod(number, 10 ** half)
    return _int_text(high) + _int_text(low).rjust(half, "0")


def _segment(source: str, node: ast.AST) -> str:
    return ast.get_source_segment(source, node) or type(node).__name__


def _short(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[:limit - 3] + "...")
