"""The demo's tiny reward model (tools/tiny_reward_model.py, `make_tiny_model.py --reward-model`):
training is deterministic (two short runs write the same bytes), and the shipped
examples/tiny/reward_model scores the held-out sums as its rm_eval.json says - correct ones above
wrong ones, near misses included. (Re-running the full 2000 steps takes minutes on two shared
cores, so the shipped weights are checked by their held-out numbers, recomputed here.)"""
import json
import os
import random
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))
import tiny_reward_model as trm  # noqa: E402

SHIPPED = os.path.join(REPO, "examples", "tiny", "reward_model")
TOKENIZER = os.path.join(REPO, "examples", "tiny", "hf")


def test_training_is_deterministic(tmp_path):
    runs = []
    for name in ("a", "b"):
        out = str(tmp_path / name)
        m = trm.train_reward_model(out, TOKENIZER, n_pairs=500, n_eval=100, steps=40, batch_size=32)
        with open(os.path.join(out, "model.safetensors"), "rb") as f:
            runs.append((f.read(), {k: v for k, v in m.items() if k != "train_s"}))
    assert runs[0][0] == runs[1][0]  # bitwise the same weights
    assert runs[0][1] == runs[1][1]
    with open(os.path.join(tmp_path, "a", "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForSequenceClassification"] and len(cfg["id2label"]) == 1


def test_shipped_model_matches_its_held_out_numbers():
    import transformers

    from megarl.common.tokenizer import load_tokenizer
    from megarl.data.tasks import AdditionTask

    with open(os.path.join(SHIPPED, "rm_eval.json")) as f:
        recorded = json.load(f)
    model = transformers.LlamaForSequenceClassification.from_pretrained(SHIPPED).float().eval()
    tok = load_tokenizer(SHIPPED)
    seed, n = recorded["seed"], recorded["n"] // 2
    held = trm.labelled_pairs(AdditionTask(2, seed).held_out(n), random.Random(seed * 7919 + trm._RM_STREAM + 1))
    got = trm.evaluate(model, held, tok, model.config.pad_token_id)
    assert got["accuracy"] == pytest.approx(recorded["accuracy"], abs=1e-9)
    assert got["auc"] == pytest.approx(recorded["auc"], abs=1e-6)
    print(f"\n[tiny-rm] held-out accuracy {got['accuracy']:.3f}, AUC {got['auc']:.4f}; near misses (units digit) "
          f"AUC {recorded['auc_units']:.4f}")
    assert got["accuracy"] >= 0.9 and got["auc"] >= 0.95
    assert got["mean_score_correct"] > 0 > got["mean_score_wrong"]
    # the hardest wrong answers, the units digit off by 1 or 2, are still told apart
    units = trm.labelled_pairs(AdditionTask(2, seed).held_out(n), random.Random(seed * 7919 + 100), "units")
    assert trm.evaluate(model, units, tok, model.config.pad_token_id)["auc"] >= 0.9
    assert os.path.getsize(os.path.join(SHIPPED, "model.safetensors")) < 1_000_000
