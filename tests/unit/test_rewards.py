"""Reward plugin contract: fn(prompt, completion, meta) -> float, loaded by "module:function"."""
import sys

import pytest

from megarl.rollout.rewards import arith_exact_match, first_word, load_reward_fn

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
    assert load_reward_fn("megarl.rollout.rewards:arith_exact_match") is arith_exact_match


@pytest.mark.parametrize("path,exc,msg", [
    ("my_rewards.good", ValueError, r"'my_rewards.good' must look like 'package.module:function'"),
    (":good", ValueError, "must look like"),
    ("no_such_module_xyz:f", ImportError, r"cannot import module 'no_such_module_xyz' of reward function 'no_such_module_xyz:f'"),
    ("broken_rewards:f", ImportError, r"'broken_rewards:f'.*does_not_exist_xyz"),
    ("my_rewards:missing", ImportError, r"'my_rewards:missing': 'my_rewards' has no attribute 'missing'"),
    ("my_rewards:not_callable", TypeError, r"'my_rewards:not_callable' is a int, not a callable"),
    ("my_rewards:two_args", TypeError, r"'my_rewards:two_args' cannot be called as fn\(prompt, completion, meta\)"),
    ("my_rewards:coro", TypeError, r"'my_rewards:coro' is async"),
])
def test_load_errors_name_the_path(plugin, path, exc, msg):
    with pytest.raises(exc, match=msg):
        load_reward_fn(path)


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
