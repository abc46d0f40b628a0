"""The calculator tool: arithmetic on model-written text through the whitelisted AST walker of
`megarl.common.safe_math` (no eval; + - * / // % ** with a size bound, math functions, pi, e).
``^`` is read as power, as models write it."""
from __future__ import annotations

from megarl.common.safe_math import REALS, UnsafeExpression, evaluate

__all__ = ["CalculatorTool", "format_number"]


def format_number(value) -> str:
    """Integers exactly; floats with 12 significant digits (integral floats without ".0")."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return format(value, ".12g")
    return str(value)


class CalculatorTool:
    name = "calculator"
    description = "Evaluate an arithmetic expression, e.g. (3 + 4) * 2 ** 3 or sqrt(2) / 2."
    parameters = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}

    def __init__(self, max_chars: int = 512):
        self.max_chars = max_chars

    async def __call__(self, expression: str) -> str:
        text = str(expression).replace("^", "**").replace("×", "*").replace("÷", "/")
        try:
            return format_number(evaluate(text, REALS, max_chars=self.max_chars))
        except UnsafeExpression as e:
            return f"error: {e}"
        except (ArithmeticError, ValueError, TypeError) as e:
            return f"error: {type(e).__name__}: {e}"
