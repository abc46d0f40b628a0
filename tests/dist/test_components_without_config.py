"""The trainer's components are built from their own sections (#22): an `Engine` and a `Critic`
from hand-made `EngineSpec`/`CriticSpec`, a `WeightPusher` from a `PushSpec`, with no `Config`
in the process - and they work: TP=2 on real megatron-core, a push into a real megarl-server
whose logprobs then match the trainer's and whose checksums verify clean."""
import json

from megarl.models.random_hf import tiny_config, write_random_hf

from distrun import start_server, torchrun


def test_engine_critic_and_pusher_built_from_specs(tmp_path):
    served = write_random_hf(str(tmp_path / "a"), tiny_config(), seed=1)  # the server starts elsewhere
    trained = write_random_hf(str(tmp_path / "b"), tiny_config(), seed=2)
    url, proc = start_server(served, str(tmp_path / "server.log"))
    try:
        out = tmp_path / "result.json"
        torchrun("spec_worker.py", 2, trained, url, out)
        r = json.loads(out.read_text())
    finally:
        proc.kill()
        proc.wait()
    assert r["version"] == 1 and r["bytes"] > 0 and r["mismatches"] == []
    # before: the server's own seed; after: the trainer's weights, to fp32 rounding
    assert r["gap_before"] > 0.1 and r["gap_after"] < 1e-5, r
    assert r["values_shape"] == [2, 13] and r["values_finite"] and r["value_pad"] == 0.0
