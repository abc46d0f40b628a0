"""tools/bench/push_latency_model.py: the arithmetic on one hand-computed case."""
import importlib.util
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("push_latency_model",
                                               os.path.join(REPO, "tools", "bench", "push_latency_model.py"))
plm = importlib.util.module_from_spec(_spec)
sys.modules["push_latency_model"] = plm  # dataclasses look their module up
_spec.loader.exec_module(plm)


def test_hand_computed_push():
    # 4e9 params in bf16 = 8 GB over PP=2: 4 GB per stage, 4 buckets of 1e9 B each.
    # gather (dense, TP=2): 4e9 * 1/2 / 400e9 = 0.005 s
    # send: 4e9 / 50e9 + 1000/2 * 1e-4 + 4 * 2e-3 = 0.08 + 0.05 + 0.008 = 0.138 s
    # stage (pipelined): 0.138 + 0.005 / 4 = 0.13925 s; total = 0.01 + 2 * 0.13925 = 0.2885 s
    m = plm.Model("x", 4e9, 1000, 0.0)
    costs = plm.Costs(link=50e9, nvlink=400e9, per_tensor=1e-4, per_bucket=2e-3, fixed=0.01, bucket_bytes=1e9)
    r = plm.predict(m, plm.Layout(tp=2, pp=2), costs)
    assert r["buckets"] == 4
    assert r["gather_s"] == pytest.approx(0.005)
    assert r["send_s"] == pytest.approx(0.138)
    assert r["total_s"] == pytest.approx(0.2885)
    # achieved rate 8e9 B / 0.2885 s; the floor: 8e9 B at the link's full rate (50e9 / 0.5 = 100e9 B/s)
    assert r["gbps"] == pytest.approx(8 / 0.2885)
    costs_half = plm.Costs(link=50e9, nvlink=400e9, per_tensor=1e-4, per_bucket=2e-3, fixed=0.01, bucket_bytes=1e9,
                           link_efficiency=0.5)
    half = plm.predict(m, plm.Layout(tp=2, pp=2), costs_half)
    assert half["floor_s"] == pytest.approx(0.08) and half["floor_share"] == pytest.approx(0.08 / 0.2885)
    # stages pushed in parallel: one stage's time
    assert plm.predict(m, plm.Layout(tp=2, pp=2), costs, parallel_stages=True)["total_s"] == pytest.approx(0.14925)


def test_experts_gather_over_ep():
    # all bytes in experts, EP=4: 3/4 of the stage's bytes reach the source over NVLink
    m = plm.Model("moe", 1e9, 10, 1.0)
    costs = plm.Costs(link=1e9, nvlink=1e9, per_tensor=0.0, per_bucket=0.0, fixed=0.0, bucket_bytes=4e9)
    r = plm.predict(m, plm.Layout(tp=8, ep=4), costs)
    assert r["gather_s"] == pytest.approx(1.5) and r["send_s"] == pytest.approx(2.0)
    assert r["total_s"] == pytest.approx(2.0 + 1.5)  # one bucket: nothing overlaps
