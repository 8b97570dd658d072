"""An exact calculator: an arithmetic expression in, its exact value as text out.

Grammar: integer and decimal literals (``12``, ``0.1``, ``1e3``, ``1_000``), binary
``+ - * / // % **``, unary ``- +`` and parentheses; parsed with ``ast``, never evaluated by
Python. Every value is a ``fractions.Fraction``, so ``0.1+0.2`` is exactly ``0.3``.

Output rule (``format_value``): an integer as its digits (``-42``); otherwise an exact decimal
when the value's decimal expansion terminates within ``MAX_DIGITS`` places (``0.125``,
``-2.5``); otherwise the reduced fraction ``p/q`` (``1/3``, ``-7/6``).

Limits, each a ``ToolError``: the expression's length (``MAX_EXPR_CHARS``), its nesting depth
(``MAX_DEPTH``), an exponent's size (``MAX_EXPONENT``, integers only) and the digits of any
value's numerator or denominator (``MAX_DIGITS``), checked before a power is computed.
"""

from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction

__all__ = ["MAX_DEPTH", "MAX_DIGITS", "MAX_EXPONENT", "MAX_EXPR_CHARS", "ToolError", "calculate",
           "evaluate", "format_value"]

MAX_EXPR_CHARS = 1000
MAX_DEPTH = 100
MAX_EXPONENT = 10_000
MAX_DIGITS = 1000
_MAX_BITS = int(MAX_DIGITS * 3.3219280948873626) + 1  # bits of a MAX_DIGITS-digit number

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_OPERATOR_TEXT = {
    ast.BitXor: "^ (use ** for powers)", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<",
    ast.RShift: ">>", ast.MatMult: "@", ast.Invert: "~", ast.Not: "not",
}


class ToolError(Exception):
    """A tool refused its input or failed; ``str(error)`` is the message shown to the model."""


def calculate(expression: str) -> str:
    """The exact value of ``expression`` as text (rule in the module docstring).

    Raises ``ToolError`` on a syntax error, division by zero, an unsupported operator, name,
    call or literal, or a limit exceeded."""
    return format_value(evaluate(expression))


def evaluate(expression: str) -> Fraction:
    """The exact value of ``expression``; raises ``ToolError`` as ``calculate`` does."""
    if not isinstance(expression, str):
        raise ToolError(f"expression must be text, not {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise ToolError("empty expression")
    if len(text) > MAX_EXPR_CHARS:
        raise ToolError(f"expression too long: {len(text)} characters, the limit is {MAX_EXPR_CHARS}")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError) as e:
        raise ToolError(f"syntax error: {getattr(e, 'msg', None) or e}") from None
    except (RecursionError, MemoryError):
        raise ToolError(f"expression nested too deeply (limit {MAX_DEPTH})") from None
    return _Evaluator(text).eval(tree.body, 0)


def _check_size(value: Fraction) -> Fraction:
    """``value``, or ``ToolError`` when its numerator or denominator exceeds ``MAX_DIGITS`` digits."""
    for part in (value.numerator, value.denominator):
        bits = part.bit_length()
        if bits > _MAX_BITS or (bits > _MAX_BITS - 4 and len(str(abs(part))) > MAX_DIGITS):
            raise ToolError(f"result too big: more than {MAX_DIGITS} digits")
    return value


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    """``base ** exponent`` for an integer exponent within ``MAX_EXPONENT``, size checked first."""
    if exponent.denominator != 1:
        raise ToolError(f"unsupported non-integer exponent {format_value(exponent)}")
    n = exponent.numerator
    if abs(n) > MAX_EXPONENT:
        raise ToolError(f"exponent too big: {n}, the limit is {MAX_EXPONENT} in size")
    if base == 0 and n < 0:
        raise ToolError("division by zero (zero to a negative power)")
    largest = max(base.numerator.bit_length(), base.denominator.bit_length())
    if (largest - 1) * abs(n) > _MAX_BITS:  # the result has at least this many bits
        raise ToolError(f"result too big: more than {MAX_DIGITS} digits")
    return _check_size(base ** n)


class _Evaluator:
    """Walks an ``ast`` expression; ``text`` is its source (decimal literals are read from it)."""

    def __init__(self, text: str):
        self.text = text

    def eval(self, node: ast.AST, depth: int) -> Fraction:
        if depth > MAX_DEPTH:
            raise ToolError(f"expression nested too deeply (limit {MAX_DEPTH})")
        if isinstance(node, ast.Constant):
            return self.literal(node)
        if isinstance(node, ast.BinOp):
            kind = type(node.op)
            if kind is ast.Pow:
                return _power(self.eval(node.left, depth + 1), self.eval(node.right, depth + 1))
            if kind not in _BINARY:
                raise ToolError(f"unsupported operator {_OPERATOR_TEXT.get(kind, kind.__name__)}")
            left, right = self.eval(node.left, depth + 1), self.eval(node.right, depth + 1)
            try:
                result = _BINARY[kind](left, right)
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            return _check_size(Fraction(result))
        if isinstance(node, ast.UnaryOp):
            kind = type(node.op)
            if kind not in _UNARY:
                raise ToolError(f"unsupported operator {_OPERATOR_TEXT.get(kind, kind.__name__)}")
            return _UNARY[kind](self.eval(node.operand, depth + 1))
        if isinstance(node, ast.Name):
            raise ToolError(f"unsupported name {node.id!r}: only numbers and operators")
        if isinstance(node, ast.Call):
            raise ToolError("unsupported function call: only numbers and operators")
        if isinstance(node, ast.Attribute):
            raise ToolError(f"unsupported attribute {node.attr!r}: only numbers and operators")
        if isinstance(node, ast.Compare):
            raise ToolError("unsupported comparison: only numbers and arithmetic operators")
        raise ToolError(f"unsupported expression ({type(node).__name__}): only numbers and operators")

    def literal(self, node: ast.Constant) -> Fraction:
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ToolError(f"unsupported literal {value!r}: only numbers")
        if isinstance(value, int):
            return _check_size(Fraction(value))
        source = (ast.get_source_segment(self.text, node) or "").replace("_", "")
        exponent = re.search(r"[eE]([-+]?\d+)$", source)
        if exponent and abs(int(exponent.group(1))) > 2 * MAX_DIGITS:
            raise ToolError(f"number too big: {source!r}")
        try:
            return _check_size(Fraction(source))
        except (ValueError, ZeroDivisionError):
            raise ToolError(f"unsupported number {source!r}") from None


def format_value(value: Fraction) -> str:
    """``value`` as text: digits, a terminating decimal, or ``p/q`` (module docstring)."""
    num, den = value.numerator, value.denominator
    if den == 1:
        return str(num)
    twos = fives = 0
    rest = den
    while rest % 2 == 0:
        rest //= 2
        twos += 1
    while rest % 5 == 0:
        rest //= 5
        fives += 1
    places = max(twos, fives)
    if rest != 1 or places > MAX_DIGITS:
        return f"{num}/{den}"
    scaled = str(abs(num) * 10 ** places // den).rjust(places + 1, "0")
    sign = "-" if num < 0 else ""
    return f"{sign}{scaled[:-places]}.{scaled[-places:]}"
