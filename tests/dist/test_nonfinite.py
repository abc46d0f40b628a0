"""A NaN loss skips the update on every rank (TP=2 x DP=1: real megatron-core over gloo) instead
of writing NaN into the weights; the next finite step trains normally."""
import json
import math

from distrun import torchrun
from megarl.models.random_hf import tiny_config, write_random_hf


def test_nan_loss_skips_the_step_on_every_rank(tmp_path):
    hf = write_random_hf(str(tmp_path / "hf"), tiny_config("LlamaForCausalLM"), seed=3)
    out = tmp_path / "out.json"
    torchrun("nonfinite_worker.py", 2, hf, 2, out)
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2
    for r in ranks:
        assert r["bad_ok"] == 0.0 and math.isnan(r["bad_norm"]) and r["unchanged"]
        assert r["step_after_bad"] == 0 and r["sched_after_bad"] == 0  # the LR schedule did not move
        assert r["good_ok"] == 1.0 and r["changed"] and r["finite"] and r["step"] == 1
