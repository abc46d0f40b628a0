"""Math answer reward: pull the final answer out of a completion and compare it to the reference.

    math_reward(prompt, completion, meta) = 1.0 if answers_match(extract_answer(completion),
                                                                 meta["answer"]) else 0.0

Extraction: the number after GSM8K's final-answer marker ``####`` when there is one, else the
content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced, so
``\\boxed{\\frac{1}{2}}`` works; ``\\boxed 5`` too), else the last number in the text. The
reference ``meta["answer"]`` is read the same way, so a full GSM8K solution ("... #### 72") works.

Comparison, first that applies:
1. the normalized strings are equal (LaTeX spacing, ``\\left``/``\\right``, ``\\text{}``,
   ``$``, degrees, a trailing period and an ``x =`` prefix are dropped first);
2. both are numbers: exactly equal as fractions, or within `rel_tol` - integers, decimals,
   ``1,234`` thousands separators, ``3/4``, ``\\frac{3}{4}``, ``1\\frac{1}{2}``, scientific
   ``1.5e3`` / ``1.5 \\times 10^{3}``, and percentages (``50%`` matches 50 and 0.5);
3. both are tuples/intervals with the same brackets: element by element;
4. sympy is installed and both parse as expressions: ``simplify(a - b) == 0`` (or numerically
   equal when both are constants). Expressions are built by the whitelisted AST walker of
   `megarl.common.safe_math`, never by sympy's `parse_expr` (which calls `eval`).
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import math
import operator
import re
from fractions import Fraction
from typing import Any, Optional

from megarl.common.safe_math import FRACTIONS, Arithmetic, UnsafeExpression, evaluate, guarded_pow

__all__ = ["extract_boxed", "last_number", "extract_answer", "parse_number", "answers_match", "math_reward"]

_NUMBER = re.compile(r"""
    (?:(?<![\w)])-)?                          # a minus sign, unless it is "a - b"
    (?<![\w.])                                # not inside a word or after a dot
    (?:\d{1,3}(?:,\d{3})+(?:\.\d+)? | \d+(?:\.\d+)? | \.\d+)
    (?:[eE][-+]?\d+)?
    (?:\s*/\s*\d+)?
    (?:\s*\\?%)?
""", re.X)
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_MIXED = re.compile(r"^(-?)(\d+)\\frac\{(\d+)\}\{(\d+)\}$")
_SCI = re.compile(r"^(.+?)(?:\\times|\\cdot|\*|×)10\^\{?([-+]?\d+)\}?$")
_WRAPPERS = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\{([^{}]*)\}")
_DROP = ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\$", "$",
         "^{\\circ}", "^\\circ", "\\circ", "°", "~")


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} / \\fbox{...} (nested braces), or of `\\boxed 5`."""
    starts = [(text.rfind(tag), tag) for tag in ("\\boxed", "\\fbox")]
    idx, tag = max(starts)
    if idx < 0:
        return None
    rest = text[idx + len(tag):]
    body = rest.lstrip()
    if body.startswith("{"):
        depth = 0
        for j, ch in enumerate(body):
            depth += {"{": 1, "}": -1}.get(ch, 0)
            if depth == 0:
                return body[1:j].strip()
        return None  # unbalanced: the generation was cut inside the box
    m = re.match(r"\s+([^\s$]+)", rest)
    return m.group(1) if m else None


def last_number(text: str) -> Optional[str]:
    matches = _NUMBER.findall(text)
    return matches[-1].strip() if matches else None


def extract_answer(text: str) -> Optional[str]:
    if "####" in text:  # GSM8K's marker: the answer is what follows the last one
        return last_number(text.rsplit("####", 1)[1])
    boxed = extract_boxed(text)
    return boxed if boxed is not None else last_number(text)


def _normalize(s: str) -> tuple[str, bool]:
    """(text without presentation noise, whether it was a percentage)."""
    s = str(s).strip().replace("−", "-").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for _ in range(3):  # nested wrappers: \text{\textbf{5}}
        s = _WRAPPERS.sub(r"\1", s)
    for token in _DROP:
        s = s.replace(token, "")
    s = s.strip().rstrip(".").strip()
    pct = s.endswith("%")
    s = s.rstrip("%").rstrip("\\").strip()
    m = re.match(r"^[A-Za-z]\w*\s*=\s*([^=]+)$", s)  # "x = 3" -> "3"
    if m:
        s = m.group(1).strip()
    m = re.match(r"^\(([A-Za-z])\)$", s)  # "(B)" -> "B"
    return (m.group(1) if m else s), pct


_NUMERIC = Arithmetic(constant=FRACTIONS.constant, binary=FRACTIONS.binary,
                      unary={ast.USub: operator.neg, ast.UAdd: operator.pos})


def _latex_arg(s: str, i: int) -> tuple[str, int]:
    """The argument of a LaTeX command starting at s[i]: a balanced {group} or one character."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        raise ValueError("missing argument")
    if s[i] != "{":
        return s[i], i + 1
    depth = 0
    for j in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1:j], j + 1
    raise ValueError("unbalanced braces")


def _frac_to_parens(s: str) -> str:
    """\\frac{a}{b} -> ((a)/(b)), \\sqrt{x} -> sqrt(x), \\sqrt[n]{x} -> ((x)**(1/(n))), nested
    arguments included; unbalanced input is returned unchanged."""
    out, i = [], 0
    try:
        while i < len(s):
            if s.startswith("\\frac", i):
                num, i = _latex_arg(s, i + 5)
                den, i = _latex_arg(s, i)
                out.append(f"(({_frac_to_parens(num)})/({_frac_to_parens(den)}))")
            elif s.startswith("\\sqrt", i):
                i += 5
                root = None
                if i < len(s) and s[i] == "[" and "]" in s[i:]:
                    j = s.index("]", i)
                    root, i = s[i + 1:j], j + 1
                arg, i = _latex_arg(s, i)
                arg = _frac_to_parens(arg)
                out.append(f"sqrt({arg})" if root is None else f"(({arg})**(1/({root})))")
            else:
                out.append(s[i])
                i += 1
    except ValueError:
        return s
    return "".join(out)


def parse_number(s: str) -> Optional[Fraction]:
    """The exact value of a numeric answer string (see module docstring), else None."""
    t = s.replace(" ", "")
    if len(t) > 64 or not t:
        return None
    if _THOUSANDS.match(t):
        t = t.replace(",", "")
    m = _MIXED.match(t)
    if m:
        value = int(m.group(2)) + Fraction(int(m.group(3)), int(m.group(4)) or 1)
        return -value if m.group(1) else value
    m = _SCI.match(t)
    if m and abs(int(m.group(2))) <= 400:
        mantissa = parse_number(m.group(1))
        return None if mantissa is None else mantissa * Fraction(10) ** int(m.group(2))
    exp = re.search(r"[eE]([-+]?\d+)$", t)
    if exp and abs(int(exp.group(1))) > 400:
        return None
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        pass
    try:
        value = evaluate(_frac_to_parens(t).replace("{", "(").replace("}", ")"), _NUMERIC, max_chars=128)
    except (UnsafeExpression, ArithmeticError, TypeError):
        return None
    return value if isinstance(value, Fraction) else None


def _numbers_match(a: Fraction, a_pct: bool, b: Fraction, b_pct: bool, rel_tol: float) -> bool:
    cands_a = [a, a / 100] if a_pct else [a]
    cands_b = [b, b / 100] if b_pct else [b]
    return any(x == y or math.isclose(float(x), float(y), rel_tol=rel_tol, abs_tol=1e-12)
               for x in cands_a for y in cands_b)


def _split_tuple(s: str) -> Optional[tuple[str, list[str]]]:
    """("()", ["1", "2"]) for "(1, 2)"; None unless bracketed with >= 2 top-level items."""
    if len(s) < 2 or s[0] + s[-1] not in ("()", "[]", "(]", "[)", "{}"):
        return None
    items, depth, cur = [], 0, ""
    for ch in s[1:-1]:
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    return (s[0] + s[-1], items) if len(items) > 1 else None


def answers_match(pred: str, ref: str, rel_tol: float = 1e-6) -> bool:
    """Whether answer `pred` equals reference `ref` (rules in the module docstring)."""
    p, p_pct = _normalize(pred)
    r, r_pct = _normalize(ref)
    if not p or not r:
        return False
    if p.replace(" ", "") == r.replace(" ", "") and p_pct == r_pct:
        return True
    pn, rn = parse_number(p), parse_number(r)
    if pn is not None and rn is not None:
        return _numbers_match(pn, p_pct, rn, r_pct, rel_tol)
    pt, rt = _split_tuple(p.replace(" ", "")), _split_tuple(r.replace(" ", ""))
    if pt and rt:
        return pt[0] == rt[0] and len(pt[1]) == len(rt[1]) and all(
            answers_match(a, b, rel_tol) for a, b in zip(pt[1], rt[1]))
    return _have_sympy() and _symbolic_match(p, r, rel_tol)


def math_reward(prompt: str, completion: str, meta: dict[str, Any]) -> float:
    """1.0 when the completion's final answer equals meta["answer"] (which may itself be boxed)."""
    ref = str(meta["answer"])
    ref = extract_answer(ref) if "####" in ref else (extract_boxed(ref) or ref)
    pred = extract_answer(completion)
    return 1.0 if pred is not None and answers_match(pred, ref) else 0.0


# ---------------------------------------------------------------------------------- symbolic
_LATEX_NAMES = {"\\pi": "pi", "\\infty": "oo", "\\cdot": "*", "\\times": "*", "\\div": "/",
                "\\ln": "log", "\\log": "log", "\\sin": "sin", "\\cos": "cos", "\\tan": "tan",
                "\\exp": "exp"}


def _latex_to_python(s: str) -> Optional[str]:
    s = _frac_to_parens(s)
    for latex, py in _LATEX_NAMES.items():
        s = s.replace(latex, f" {py} ")
    if "\\" in s:
        return None  # LaTeX we do not translate
    s = s.replace("{", "(").replace("}", ")").replace("^", "**")
    s = re.sub(r"(\d)\s*([A-Za-z(])", r"\1*\2", s)  # 2x, 2(x+1), 2sqrt(3)
    s = re.sub(r"\)\s*([\w(])", r")*\1", s)  # (x+1)(x-1), (a)b
    return s


def _sympy_pow(a, b):
    """Numbers: guarded_pow's size bound; symbols: exponents up to 64 (simplify expands them)."""
    if a.is_Number and b.is_Number:
        return guarded_pow(a, b, max_bits=1024)
    if b.is_Number and abs(b) > 64:
        raise UnsafeExpression(f"exponent too large ({b})")
    return a ** b


def _to_sympy(s: str):
    import sympy

    text = _latex_to_python(s)
    if text is None:
        return None
    arith = Arithmetic(
        constant=lambda v: sympy.Rational(repr(v)) if isinstance(v, float) else sympy.Integer(v),
        binary={ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                ast.Div: operator.truediv, ast.Pow: _sympy_pow},
        unary={ast.USub: operator.neg, ast.UAdd: operator.pos},
        names={"pi": sympy.pi, "e": sympy.E, "oo": sympy.oo, "i": sympy.I},
        functions={"sqrt": sympy.sqrt, "log": sympy.log, "sin": sympy.sin, "cos": sympy.cos,
                   "tan": sympy.tan, "exp": sympy.exp, "abs": sympy.Abs},
        name_fallback=sympy.Symbol)
    try:
        return evaluate(text, arith, max_chars=256, max_nodes=128)
    except (UnsafeExpression, ArithmeticError, TypeError, ValueError):
        return None


@functools.lru_cache(maxsize=1)
def _have_sympy() -> bool:
    """sympy is optional (the test/math extras); looked up here, not via megarl.common.compat, so that a
    reward worker process never imports torch."""
    return importlib.util.find_spec("sympy") is not None


def _symbolic_match(p: str, r: str, rel_tol: float) -> bool:
    import sympy

    a, b = _to_sympy(p), _to_sympy(r)
    if a is None or b is None:
        return False
    try:
        diff = sympy.simplify(a - b)
        if diff == 0:
            return True
        if not diff.free_symbols:
            scale = max(1.0, abs(complex(sympy.N(b))))
            return abs(complex(sympy.N(diff))) <= rel_tol * scale
    except (TypeError, ValueError, ArithmeticError, AttributeError):
        return False
    return False
