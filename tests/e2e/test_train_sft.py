"""The main job end to end: `megarl-train` SFT on the tiny demo task, single rank and TP=2 (the
entry starts its own ranks), with progress, metrics.jsonl and an HF export that reloads."""
import json
import os

import harness
import pytest


@pytest.mark.parametrize("layout", [[], ["parallel.tp=2"]], ids=["tp1", "tp2_self_launched"])
def test_sft_loss_goes_down_and_exports(tmp_path, layout):
    run = tmp_path / "run"
    proc = harness.train(run, f"checkpoint.hf_export_dir={run}/model", "train.steps=40",
                         "checkpoint.hf_export_interval=20", "optim.lr_warmup_steps=5", *layout,
                         recipe="tiny_sft.yaml", model=harness.TINY / "hf", data=harness.TINY / "data" / "sft.jsonl",
                         check=True)
    rows = proc.rows
    assert [r["step"] for r in rows] == list(range(1, 41))
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-5:]) / 5
    assert last < 0.75 * first, (first, last)  # random init: ~log(16) -> well below
    assert "sft [" in proc.stderr and "40/40" in proc.stderr  # progress bar
    assert (run / "config.yaml").exists()
    files = sorted(os.listdir(run / "model"))
    assert {"config.json", "model.safetensors", "tokenizer.model"} <= set(files)
    cfg = json.loads((run / "model" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["vocab_size"] == 16
    # the export is a real HF checkpoint: transformers loads it and it predicts the task
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(run / "model"))
    ids = torch.tensor([[1, 4, 5, 13, 6, 7, 14, 8, 10]])  # "<s>12+34=57"-style tokens
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 9, 16) and torch.isfinite(logits).all()


def test_chat_sft_packed_trains_the_numbers_of_pairs_when_the_template_writes_pairs(tmp_path):
    """Chat SFT (data.messages_key) end to end: the demo's pairs as one-exchange conversations,
    through a chat template that writes BOS, the prompt, the answer and EOS, packed
    (train.pack_sequences): the same tokens and loss masks as prompt/response SFT
    (tests/unit/test_chat_sft.py), so the same losses and gradient norms, step by step."""
    rows = [json.loads(x) for x in (harness.TINY / "data" / "sft.jsonl").read_text().splitlines()[:512]]
    plain, chats, template = tmp_path / "pairs.jsonl", tmp_path / "chats.jsonl", tmp_path / "template.jinja"
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows))
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": r["prompt"]},
                                                      {"role": "assistant", "content": r["response"]}]}) + "\n"
                             for r in rows))
    template.write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
                        "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}")
    common = ("train.steps=6", "train.pack_sequences=true", "model.attention=sdpa", "checkpoint.hf_export_dir=")
    a = harness.train(tmp_path / "pairs", *common, recipe="tiny_sft.yaml", model=harness.TINY / "hf", data=plain,
                      check=True)
    b = harness.train(tmp_path / "chats", *common, "data.messages_key=messages", f"data.chat_template={template}",
                      recipe="tiny_sft.yaml", model=harness.TINY / "hf", data=chats, check=True)
    assert len(a.rows) == len(b.rows) == 6
    for x, y in zip(a.rows, b.rows):
        assert (x["loss"], x["grad_norm"]) == (y["loss"], y["grad_norm"])
    assert a.rows[-1]["loss"] < a.rows[0]["loss"]
