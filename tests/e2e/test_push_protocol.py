"""The weight-update protocol runs once per push: a recording proxy in front of a real
megarl-server counts every admin call the GRPO loop makes (real trainer, real server; the proxy
only forwards and counts)."""
import collections
import os

import harness
from e2e_servers import ForwardingProxy, ServerProc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ADMIN = ("pause_generation", "continue_generation", "flush_cache", "begin_weight_update",
         "end_weight_update", "update_weight_version", "update_weights_from_tensor")


class RecordingProxy(ForwardingProxy):
    """Forwards every request to ``target`` unchanged and counts requests per path."""

    def __init__(self, target: str):
        self.counts = collections.Counter()
        super().__init__(target, lambda path: self.counts.update([path.strip("/")]))


def test_one_pause_and_one_continue_per_push(tmp_path):
    server = ServerProc(f"{REPO}/examples/tiny/model").wait_ready()
    try:
        proxy = RecordingProxy(server.url)
        run = harness.train(tmp_path / "run", "train.global_batch_size=64", "rollout.eval_at_start=false",
                            "train.steps=3", f"rollout.servers=[{proxy.url}]", "weights.transport=tensor",
                            "rollout.max_staleness=1", check=True)
    finally:
        server.stop()
    rows = run.rows
    assert [r["step"] for r in rows] == [1, 2, 3]
    pushes = 1 + 3  # the initial push (servers get the trainer's weights) + one per step
    counts = {name: proxy.counts[name] for name in ADMIN}
    assert counts["pause_generation"] == counts["continue_generation"] == pushes, counts
    assert counts["flush_cache"] == counts["update_weight_version"] == pushes, counts
    assert counts["begin_weight_update"] == counts["end_weight_update"] == pushes, counts
    assert counts["update_weights_from_tensor"] >= pushes, counts  # one per bucket
    assert proxy.counts["generate"] > 0
