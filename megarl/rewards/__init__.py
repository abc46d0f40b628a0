"""Reward functions: the plugin contract and loader (`base`), the awaitable `RewardCaller`
workflows use, and the built-in verifiers - exact match and prefix credit (`text`), math answers
(`math_answer`), Countdown (`countdown`) and a reward served over HTTP (`http`). Import paths such as
``megarl.rewards:math_reward`` resolve here.
"""
from megarl.rewards.base import RewardCaller, RewardError, RewardFn, is_async_callable, load_reward_fn
from megarl.rewards.countdown import check_countdown, countdown_reward, extract_equation
from megarl.rewards.http import HttpReward, HttpRewardError
from megarl.rewards.math_answer import (answers_match, extract_answer, extract_boxed, last_number,
                                                math_reward, parse_number)
from megarl.rewards.text import arith_exact_match, first_word, prefix_match

__all__ = [
    "HttpReward",
    "HttpRewardError",
    "RewardCaller",
    "RewardError",
    "RewardFn",
    "answers_match",
    "arith_exact_match",
    "check_countdown",
    "countdown_reward",
    "extract_answer",
    "extract_boxed",
    "extract_equation",
    "first_word",
    "is_async_callable",
    "last_number",
    "load_reward_fn",
    "math_reward",
    "parse_number",
    "prefix_match",
]
