"""Arithmetic on untrusted text (model output) without `eval`: a whitelisted Python AST walker.

The expression is parsed with ``ast.parse(mode="eval")`` (parsing runs no code) and evaluated
node by node; anything outside the whitelist - attribute access, subscripts, comprehensions,
lambdas, keywords, names not in the table, string constants - raises `UnsafeExpression`. Sizes
are bounded so a short input cannot take long: at most `max_chars` characters and `max_nodes`
AST nodes, and powers are refused when the result would exceed ~`max_pow_bits` bits.

One walker, three number systems (chosen by the caller's `Arithmetic`):
- `FRACTIONS`: exact rationals, + - * / only (the countdown reward),
- `REALS`: ints stay exact, floats otherwise, powers and math functions (the calculator tool),
- sympy objects, built by `megarl.rewards.math_answer` for symbolic answer checks.
"""
from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable

__all__ = ["UnsafeExpression", "Arithmetic", "FRACTIONS", "REALS", "evaluate", "guarded_pow"]


class UnsafeExpression(ValueError):
    """The text is not an expression this evaluator accepts (or would be too costly)."""


def guarded_pow(base, exp, max_bits: int = 4096):
    """base ** exp, refused when |result| would need more than ~max_bits bits."""
    try:
        b, e = abs(float(base)), float(exp)
    except (OverflowError, TypeError, ValueError):
        raise UnsafeExpression("power operands are too large") from None
    if b > 1 and e > 0 and e * math.log2(b) > max_bits:
        raise UnsafeExpression(f"power too large ({base}**{exp})")
    if 0 < b < 1 and e < 0 and -e * -math.log2(b) > max_bits:
        raise UnsafeExpression(f"power too large ({base}**{exp})")
    if isinstance(exp, int) and abs(exp) > 10 * max_bits:  # 1 ** huge still loops in C
        raise UnsafeExpression(f"exponent too large ({exp})")
    return operator.pow(base, exp)


@dataclass
class Arithmetic:
    """A number system for the walker: how constants become values and which operators,
    names and functions exist. `on_number(value)` sees every numeric literal (e.g. to check
    which numbers an expression used)."""

    constant: Callable[[int | float], Any]
    binary: dict[type, Callable[[Any, Any], Any]]
    unary: dict[type, Callable[[Any], Any]] = field(default_factory=dict)
    names: dict[str, Any] = field(default_factory=dict)
    functions: dict[str, Callable[..., Any]] = field(default_factory=dict)
    allow_floats: bool = True
    name_fallback: Callable[[str], Any] | None = None  # unknown names (e.g. sympy symbols)


def _exact_constant(value: int | float) -> Fraction:
    return Fraction(repr(value)) if isinstance(value, float) else Fraction(value)


def _checked_div(a, b):
    if b == 0:
        raise UnsafeExpression("division by zero")
    return a / b


FRACTIONS = Arithmetic(
    constant=_exact_constant,
    binary={ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: _checked_div},
    allow_floats=False,
)


def _real_div(a, b):
    if b == 0:
        raise UnsafeExpression("division by zero")
    q = a / b
    return int(q) if isinstance(a, int) and isinstance(b, int) and a % b == 0 else q


def _real_floordiv(a, b):
    if b == 0:
        raise UnsafeExpression("division by zero")
    return a // b


def _real_mod(a, b):
    if b == 0:
        raise UnsafeExpression("modulo by zero")
    return a % b


def _factorial(n):
    if not isinstance(n, int) or n < 0 or n > 1000:
        raise UnsafeExpression("factorial needs an integer in [0, 1000]")
    return math.factorial(n)


REALS = Arithmetic(
    constant=lambda v: v,
    binary={ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: _real_div,
            ast.FloorDiv: _real_floordiv, ast.Mod: _real_mod, ast.Pow: guarded_pow},
    unary={ast.USub: operator.neg, ast.UAdd: operator.pos},
    names={"pi": math.pi, "e": math.e, "tau": math.tau},
    functions={"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max, "floor": math.floor,
               "ceil": math.ceil, "exp": math.exp, "log": math.log, "log10": math.log10, "log2": math.log2,
               "sin": math.sin, "cos": math.cos, "tan": math.tan, "asin": math.asin, "acos": math.acos,
               "atan": math.atan, "factorial": _factorial, "gcd": math.gcd, "lcm": math.lcm,
               "comb": math.comb, "perm": math.perm},
)


def evaluate(text: str, arith: Arithmetic, *, max_chars: int = 512, max_nodes: int = 256,
             on_number: Callable[[Any], None] | None = None) -> Any:
    """Value of `text` under `arith`; UnsafeExpression for anything outside the whitelist."""
    if len(text) > max_chars:
        raise UnsafeExpression(f"expression longer than {max_chars} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise UnsafeExpression(f"not an expression: {e}") from None
    if sum(1 for _ in ast.walk(tree)) > max_nodes:
        raise UnsafeExpression(f"expression has more than {max_nodes} nodes")
    return _Walker(arith, on_number).visit(tree.body)


class _Walker:
    def __init__(self, arith: Arithmetic, on_number):
        self.arith, self.on_number = arith, on_number

    def visit(self, node: ast.AST) -> Any:
        a = self.arith
        if isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not a.allow_floats):
                raise UnsafeExpression(f"constant {v!r} is not allowed")
            if self.on_number is not None:
                self.on_number(v)
            return a.constant(v)
        if isinstance(node, ast.BinOp) and type(node.op) in a.binary:
            return a.binary[type(node.op)](self.visit(node.left), self.visit(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in a.unary:
            return a.unary[type(node.op)](self.visit(node.operand))
        if isinstance(node, ast.Name):
            if node.id in a.names:
                return a.names[node.id]
            if a.name_fallback is not None and node.id not in a.functions:
                return a.name_fallback(node.id)
            raise UnsafeExpression(f"unknown name {node.id!r}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in a.functions
                and not node.keywords):
            return a.functions[node.func.id](*[self.visit(arg) for arg in node.args])
        raise UnsafeExpression(f"{type(node).__name__} is not allowed")
