"""Built-in verifiers against tables: the math answer checker (extraction + numeric and symbolic
equivalence, 53 answer forms) and the Countdown reward; plus the safe evaluator's refusals."""
import pytest

from megarl.common.compat import HAVE_SYMPY
from megarl.rewards import (answers_match, countdown_reward, extract_answer, extract_boxed, math_reward,
                                    parse_number)
from megarl.common.safe_math import REALS, UnsafeExpression, evaluate

needs_sympy = pytest.mark.skipif(not HAVE_SYMPY, reason="symbolic equivalence needs sympy")

# (completion, reference answer, expected reward)
MATH_TABLE = [
    (r"so the answer is \boxed{42}.", "42", 1.0),
    (r"\boxed{42}", 42, 1.0),  # numeric references are compared as text
    (r"\boxed{ 42 }", "42", 1.0),
    (r"The answer is \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\dfrac{3}{4}}", "3/4", 1.0),
    (r"\boxed{0.75}", r"\frac34", 1.0),
    (r"\boxed{\tfrac{6}{8}}", "0.75", 1.0),
    (r"\boxed{-\frac{1}{2}}", "-0.5", 1.0),
    (r"\boxed{\frac{-1}{2}}", "-1/2", 1.0),
    (r"\boxed{1\frac{1}{2}}", "3/2", 1.0),  # mixed number
    (r"\boxed{\frac{1}{\frac{1}{2}}}", "2", 1.0),  # nested braces
    ("in total x = 1,234", "1234", 1.0),  # last number, thousands separator
    (r"\boxed{1,234,567}", "1234567", 1.0),
    (r"\boxed{1\,000}", "1000", 1.0),  # LaTeX thin space
    (r"\boxed{50\%}", "50", 1.0),
    (r"\boxed{50\%}", "0.5", 1.0),
    ("about 12.5% of them", "0.125", 1.0),
    (r"\boxed{1.5 \times 10^{3}}", "1500", 1.0),
    (r"\boxed{2\cdot10^{-2}}", "0.02", 1.0),
    ("roughly 1.5e3 units", "1500", 1.0),
    (r"\boxed{2.5E-3}", "0.0025", 1.0),
    (r"\boxed{-7}", "-7", 1.0),
    ("\\boxed{\u22127}", "-7", 1.0),  # unicode minus
    (r"\boxed{\$18.90}", "18.9", 1.0),
    (r"\boxed{\text{5 cm}}", "5 cm", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{x = 3}", "3", 1.0),
    (r"\boxed{3.0}", "3", 1.0),
    (r"\boxed{1/3}", "0.3333333333", 1.0),  # within rel_tol 1e-6
    (r"\boxed{(1, 2)}", "(1,2)", 1.0),
    (r"\boxed{\left( 3, \frac{1}{2} \right)}", "(3,0.5)", 1.0),
    (r"\boxed{\text{(B)}}", "B", 1.0),
    (r"\boxed{\infty}", r"\infty", 1.0),
    (r"\boxed 5", "5", 1.0),
    (r"\fbox{7}", "7", 1.0),
    (r"first \boxed{3} then \boxed{4}", "4", 1.0),  # the last box counts
    ("12 apples, then 15.", "15", 1.0),
    ("10-3=7", "7", 1.0),
    ("the answer is 8", r"\boxed{8}", 1.0),  # boxed reference
    (r"\boxed{42}", "43", 0.0),
    (r"\boxed{0.33}", "1/3", 0.0),
    (r"\boxed{10\%}", "0.2", 0.0),
    (r"\boxed{(1, 2)}", "[1,2]", 0.0),  # open vs closed interval
    ("no answer here", "5", 0.0),
    (r"\boxed{}", "5", 0.0),
    (r"\boxed{\frac{1}{2}", "0.5", 0.0),  # cut inside the box, no number outside it
]

SYMBOLIC_TABLE = [
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", 1.0),
    (r"\boxed{\pi/2}", r"\frac{\pi}{2}", 1.0),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    (r"\boxed{\sqrt[3]{8}}", "2", 1.0),
    (r"\boxed{2x}", "2y", 0.0),
    (r"\boxed{\sqrt{2}}", "1.414", 0.0),
]


def test_table_is_large_enough():
    assert len(MATH_TABLE) + len(SYMBOLIC_TABLE) >= 30


@pytest.mark.parametrize("completion,answer,expected", MATH_TABLE)
def test_math_reward_table(completion, answer, expected):
    out = math_reward("prompt", completion, {"answer": answer})
    assert type(out) is float and out == expected


@needs_sympy
@pytest.mark.parametrize("completion,answer,expected", SYMBOLIC_TABLE)
def test_math_reward_symbolic(completion, answer, expected):
    assert math_reward("prompt", completion, {"answer": answer}) == expected


def test_extraction_and_parsing_details():
    assert extract_boxed(r"a \boxed{\frac{a}{b}} b") == r"\frac{a}{b}"
    assert extract_boxed("nothing") is None
    assert extract_answer("costs -3.5 or 7") == "7"
    assert extract_answer("x-4") == "4"
    assert parse_number("1e999") is None  # exponent bound: no huge integers from short text
    assert parse_number("2/0") is None
    assert answers_match("0.5", "1/2") and not answers_match("", "0")


def test_reward_code_never_evaluates_python():
    hostile = r"\boxed{__import__('os').system('echo pwned')}"
    assert math_reward("p", hostile, {"answer": "0"}) == 0.0
    for text in ("__import__('os')", "(1).__class__", "[x for x in ()]", "lambda: 1", "'a' * 3", "9**9**9"):
        with pytest.raises(UnsafeExpression):
            evaluate(text, REALS)
    assert evaluate("2**10 + sqrt(16) - 7 // 2", REALS) == 1025.0


COUNTDOWN = [
    ("<answer>(6 - 2) * 5</answer>", 1.0),
    ("<answer>5 * (6 - 2) = 20</answer>", 1.0),  # "= target" tail ignored
    ("thinking... <answer>6*5</answer> no wait <answer>(6-2)*5</answer>", 1.0),  # last answer tag
    (r"\boxed{(6 - 2) \times 5}", 1.0),
    ("I'll try:\n(6-2)*5", 1.0),  # last line
    ("<answer>20</answer>", 0.0),  # 20 is not a given number
    ("<answer>5 * 2 * 2</answer>", 0.0),  # 2 given once, used twice
    ("<answer>6 * 5 - 2</answer>", 0.0),  # 28, not 20
    ("<answer>-2 * -5 * 2</answer>", 0.0),  # unary minus is not a move
    ("<answer>(6 - 2.0) * 5</answer>", 0.0),  # no floats
    ("<answer>6 / (2 - 2) * 5</answer>", 0.0),  # division by zero
    ("<answer>__import__('os')</answer>", 0.0),
    ("", 0.0),
]


@pytest.mark.parametrize("completion,expected", COUNTDOWN)
def test_countdown_reward(completion, expected):
    assert countdown_reward("p", completion, {"numbers": [6, 2, 5], "target": 20}) == expected


def test_countdown_fractions_and_repeated_numbers():
    meta = {"numbers": [3, 3, 8, 8], "target": 24}
    assert countdown_reward("p", "<answer>8 / (3 - 8 / 3)</answer>", meta) == 1.0  # exact rationals
    assert countdown_reward("p", "<answer>8 / (3 - 8 / 3) + 3 - 3</answer>", meta) == 0.0  # 3 used 3x
