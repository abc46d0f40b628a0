"""Reward plugin contract: fn(prompt, completion, meta) -> float (sync or async), loaded by
"module:function" (a class is built with reward.args)."""
import asyncio
import sys

import pytest

from megarl.rewards import arith_exact_match, first_word, load_reward_fn, prefix_match

PLUGIN = '''
def good(prompt, completion, meta):
    return float(len(completion))

def with_default(prompt, completion, meta, scale=2.0):
    return scale

def two_args(prompt, completion):
    return 0.0

async def coro(prompt, completion, meta):
    return 1.0

class Scorer:
    def __call__(self, prompt, completion, meta):
        return 0.5

scorer = Scorer()
not_callable = 3

class Scaled:
    def __init__(self, scale):
        self.scale = scale

    async def __call__(self, prompt, completion, meta):
        return self.scale * len(completion)
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(PLUGIN)
    (tmp_path / "broken_rewards.py").write_text("import does_not_exist_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    for m in ("my_rewards", "broken_rewards"):
        sys.modules.pop(m, None)


def test_loads_valid_plugins(plugin):
    assert load_reward_fn(f"{plugin}:good")("p", "abc", {}) == 3.0
    assert load_reward_fn(f"{plugin}:with_default")("p", "c", {}) == 2.0
    assert load_reward_fn(f"{plugin}:scorer")("p", "c", {}) == 0.5
    assert load_reward_fn("megarl.rewards:arith_exact_match") is arith_exact_match
    assert load_reward_fn(f"{plugin}:coro").__name__ == "coro"  # async functions are allowed
    built = load_reward_fn(f"{plugin}:Scaled", {"scale": 2.0})
    assert built.scale == 2.0 and asyncio.run(built("p", "abc", {})) == 6.0


@pytest.mark.parametrize("path,exc,msg", [
    ("my_rewards.good", ValueError, r"'my_rewards.good' must look like 'package.module:function'"),
    (":good", ValueError, "must look like"),
    ("no_such_module_xyz:f", ImportError, r"cannot import module 'no_such_module_xyz' of reward function 'no_such_module_xyz:f'"),
    ("broken_rewards:f", ImportError, r"'broken_rewards:f'.*does_not_exist_xyz"),
    ("my_rewards:missing", ImportError, r"'my_rewards:missing': 'my_rewards' has no attribute 'missing'"),
    ("my_rewards:not_callable", TypeError, r"'my_rewards:not_callable' is a int, not a callable"),
    ("my_rewards:two_args", TypeError, r"'my_rewards:two_args' cannot be called as fn\(prompt, completion, meta\)"),
    ("my_rewards:Scaled", TypeError, r"reward class 'my_rewards:Scaled' cannot be built from reward.args \{\}"),
])
def test_load_errors_name_the_path(plugin, path, exc, msg):
    with pytest.raises(exc, match=msg):
        load_reward_fn(path)
    with pytest.raises(TypeError, match=r"reward.args \['scale'\] given but 'my_rewards:good' is not a class"):
        load_reward_fn("my_rewards:good", {"scale": 1})


@pytest.mark.parametrize("completion,reward", [
    ("46", 1.0), ("46</s>", 1.0), ("46\n12", 1.0), (" 46 junk", 1.0), ("46<|endoftext|>7", 1.0),
    ("460", 0.0), ("4", 0.0), ("", 0.0), ("</s>46", 0.0), ("45", 0.0),
])
def test_arith_exact_match(completion, reward):
    out = arith_exact_match("12+34=", completion, {"answer": "46"})
    assert type(out) is float and out == reward


def test_arith_answer_may_be_an_int():
    assert arith_exact_match("99+1=", "100", {"answer": 100}) == 1.0
    assert first_word("  7 8") == "7"


def test_prefix_match_credits_the_right_characters_before_the_first_wrong_one():
    meta = {"answer": "100+101+102"}  # 11 characters
    assert prefix_match("", "100+101+102</s>", meta) == 1.0
    assert prefix_match("", "100+101+103", meta) == 10 / 11  # wrong at the last character
    assert prefix_match("", "100+101", meta) == 7 / 11  # stopped early
    assert prefix_match("", "100+101+102+103", meta) == 11 / 15  # ran on past the answer
    assert prefix_match("", "200+101+102", meta) == 0.0
    assert prefix_match("", "", meta) == 0.0 and prefix_match("", "", {"answer": ""}) == 1.0
    assert load_reward_fn("megarl.rewards:prefix_match") is prefix_match
