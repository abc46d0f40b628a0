"""MoE RL end to end with routing replay (R3): `megarl-train` on a tiny random Qwen3-MoE (4 experts,
top-2, 4 layers) with the local megarl CPU server, expert parallelism EP=2 over 2 ranks,
moe.routing_replay=rollout, prox logprobs recomputed, two optimizer steps per RL step, async
(max_staleness 1).

Asserts, per step: the rollout's routes reached the trainer for every fed position (prompt and
generated tokens, the last one excepted: it fed no sampled token) and every layer; at the weights
the rollouts came from, the trainer's logprobs equal the server's within 1e-5 (the mismatch
metric: same tokens, same weights, routes replayed); and after the routers were updated (the
second optimizer step of a step, later steps' stale tokens) the trainer's own router picks other
experts for a measurable share of the replayed routes - what a run without replay would have
used, and the step's prox recompute scored again without replay (moe.replay_check) differs by
more than 1e-3 nats on average at a later step."""
import shutil

import harness

from megarl.models.random_hf import tiny_config, write_random_hf


def test_moe_grpo_replays_rollout_routes(tmp_path):
    model = tmp_path / "moe"
    write_random_hf(str(model), tiny_config("Qwen3MoeForCausalLM", vocab_size=16, max_position_embeddings=64),
                    seed=5, std=0.2)
    shutil.copy(harness.TINY / "model" / "tokenizer.model", model / "tokenizer.model")
    rows = harness.train(tmp_path / "run", "checkpoint.save_interval=0",
                         "train.steps=3", "train.global_batch_size=16", "train.ppo_mini_batch_size=8",
                         "rollout.eval_at_start=false", "rollout.max_new_tokens=6", "optim.lr=0.02",
                         "optim.lr_warmup_steps=0", "algo.prox_logp_mode=recompute", "parallel.ep=2",
                         "parallel.world_size=2", "moe.routing_replay=rollout", "moe.replay_check=true",
                         "rollout.reward_fn=reward_plugins:length_reward",  # varies within a group: real updates
                         model=model, env=harness.plugin_env(), timeout=300, check=True).rows
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["moe/routes_frac"] == 1.0  # every fed position, every layer
        assert r["optimizer_steps"] == 2
    assert rows[0]["grad_norm"] > 0  # a real update (later steps may reach the length cap: equal rewards)
    # step 1: rollouts of the very weights it starts from; the recompute replays their routes
    assert rows[0]["mismatch/onpolicy_frac"] == 1.0 and rows[0]["staleness_max"] == 0
    assert all(r["mismatch/mean"] <= 1e-5 and r["mismatch/max"] <= 1e-5 for r in rows), rows
    # the routers moved: the trainer's own top-k differs from the replayed one on a share of routes,
    # and the same prox recompute without replay gives other logprobs (moe.replay_check) - at step 1
    # (tokens of the step-start weights) it gives the same ones
    assert max(r["moe/route_flip_frac"] for r in rows) > 0.01, [r["moe/route_flip_frac"] for r in rows]
    assert rows[0]["moe/replay_logp_delta_max"] <= 1e-5
    assert max(r["moe/replay_logp_delta_mean"] for r in rows[1:]) > 1e-3, rows
