"""megarl-train's own path (rollout manager, local server) with shard-to-shard refit: a TP=2
trainer pushes with weights.refit=shard into a megarl-server --tp 2 every step. Step 1 trains on
rollouts of the weights it starts from, so the servers' logprobs must equal the trainer's
(logp_gap <= 1e-5); every push's checksum verify agrees; the bytes are the model's plus the
replicated tensors sent to the second server rank."""
import harness
from safetensors.torch import load_file


def test_grpo_tp2_trainer_shard_refit_into_tp2_server(tmp_path):
    run = tmp_path / "run"
    tiny = harness.TINY
    proc = harness.train(run, "checkpoint.hf_export_dir=model",  # the recipe's: the TP=2 export too
                         "train.steps=2", "rollout.eval_at_start=false", "rollout.eval_interval=0",
                         "train.global_batch_size=32", "parallel.tp=2", "weights.refit=shard",
                         "rollout.server_args=[--tp,2]",
                         "weights.verify_interval=1",  # checksums of every push (auto: every 10th)
                         eval_data=f"{tiny}/data/eval_prompts.jsonl", timeout=300, check=True)
    assert "2 TP ranks" in (run / "servers" / "server0.log").read_text()
    rows = proc.rows
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["logp_gap"] <= 1e-5 and rows[0]["staleness_max"] == 0
    model = load_file(f"{tiny}/model/model.safetensors")
    hidden, vocab = model["model.norm.weight"].numel(), model["model.embed_tokens.weight"].shape[0]
    norms = sum(1 for n in model if n.endswith("norm.weight"))
    # replicated on the server: embedding, lm_head, the norms -> sent to both server ranks
    extra = 4 * (2 * vocab * hidden + norms * hidden)
    for r in rows:
        assert r["push/verify_mismatches"] == 0
        assert r["push/bytes"] == 4 * sum(t.numel() for t in model.values()) + extra
