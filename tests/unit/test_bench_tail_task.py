"""The task of tools/bench/bench_tail_vs_trl.py (issue 46's shape): prompts ``N:K=`` whose answers
count K three-digit numbers down from N, K heavy-tailed with P(K >= k) = 2 / (k + 1) on [1, 32], so
answers are 4-128 tokens with EOS; the same rows for the same seed."""
import collections
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "tools", "bench"))
bench = pytest.importorskip("bench_tail_vs_trl")


def test_answers_count_down_and_the_tail_is_as_stated():
    rows = bench.sample_rows(40000, seed=3)
    assert rows[:50] == bench.sample_rows(50, seed=3)  # seeded
    ks = collections.Counter()
    for r in rows:
        n, k = map(int, r["prompt"].rstrip("=").split(":"))
        assert r["answer"] == ",".join(str(n - i) for i in range(k)) and 100 <= n - k + 1 and n <= 999
        assert 4 <= len(r["answer"]) + 1 <= 128  # characters = tokens (char-level), EOS included
        ks[k] += 1
    for k in (1, 2, 4, 8, 16, 32):
        share = sum(c for kk, c in ks.items() if kk >= k) / len(rows)
        assert share == pytest.approx(2 / (k + 1), abs=0.01), k
    assert bench.countdown(101, 2) == "101,100"
