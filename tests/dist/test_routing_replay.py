"""MoE routing replay (moe.routing_replay=rollout) in the trainer, at EP=2 and PP=2 (world 2):
a tiny random Qwen3-MoE (4 experts, top-2, 4 layers, built with transformers); the rollout side
is the megarl-server model, which gives per-token logprobs and routes (ids + weights).

- replaying the server's routes, the trainer's logprobs equal the server's within 1e-5;
- after the trainer's routers alone were moved (the experts they pick change), replaying ids and
  weights still gives the server's logprobs within 1e-5, while no replay and ids-only replay
  (weights from the moved router) differ by > 1e-3 - so the hook really forces the routes;
- every routed position of every local MoE layer was replayed (exact count);
- a replayed training step still moves the routers (straight-through gradient).
At EP=2 the budget of 32 tokens packs the two ranks' shares into 1 and 2 micro-batches: the
engine's filler micro-batch keeps the all-to-alls paired (without it this layout hung)."""
import json

import pytest

from distrun import torchrun
from hf_models import save_random

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("replay")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=211, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=128, norm_topk_prob=True, tie_word_embeddings=False,
        rms_norm_eps=1e-6)
    save_random(transformers, cfg, str(d / "hf"), seed=3)
    return d


def gap(a, b):
    return max(abs(x - y) for r, s in zip(a, b) for x, y in zip(r[1:], s[1:]))


LAYOUTS = ["1,2", "2,1"]  # "pp,ep"


@pytest.fixture(scope="module")
def results(model_dir):
    """Both layouts in one launch: {layout: record}."""
    torchrun("replay_worker.py", 2, model_dir / "hf", model_dir / "results.json", *LAYOUTS)
    return json.loads((model_dir / "results.json").read_text())


@pytest.mark.parametrize("layout", LAYOUTS, ids=["ep2", "pp2"])
def test_replay_forces_the_rollout_routes(results, layout):
    r = results[layout]
    server = r["server"]
    assert gap(r["replay"], server) <= 1e-5
    assert gap(r["plain"], server) <= 1e-4  # same weights: the routers agree anyway
    assert gap(r["moved_replay"], server) <= 1e-5
    assert gap(r["moved_plain"], server) > 1e-3
    assert gap(r["moved_ids_only"], server) > 1e-3
    assert gap(r["moved_ids_only"], r["moved_plain"]) > 1e-4  # ids were forced, weights were not
    # rank 0's rows (EP=2: DP=2, rows 0 and 2; PP=2: all rows) x its stage's MoE layers
    positions = (9 - 1) + (6 - 1) if layout == "1,2" else (9 + 14 + 6 + 20 - 4)
    assert r["layers_per_rank"] == (4 if layout == "1,2" else 2)
    assert r["replayed_tokens"] == positions * r["layers_per_rank"]
    assert r["router_step"] > 1e-4 and r["grad_norm"] > 0
