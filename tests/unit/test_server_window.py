"""Sliding-window attention in the CPU server against transformers fp32 (tiny random models built
WITH transformers), on sequences several windows long: Mistral (every layer), Qwen2 with
``use_sliding_window`` + ``max_window_layers`` (from the saved ``layer_types`` and, with that key
removed, from ``max_window_layers`` itself), Qwen3 with an explicit alternating ``layer_types``,
Qwen3-MoE (every layer). Prompts shorter and longer than the window are prefilled in one batch and
continued by batched decode steps, so both the prefill mask and the decode window over the KV cache
are checked (<= 1e-5 per token). The window really changes the numbers, and the server no longer
caps the context at the window."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hf_models import save_random
from test_server_model import _teacher_forced

from megarl.server import build_state
from megarl.server.model import CausalLM, DecoderConfig
from megarl.server.weights import read_hf_dir

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6)
CASES = {
    "mistral": (lambda: transformers.MistralConfig(**COMMON, sliding_window=5), (5, 5, 5)),
    "qwen2_max_window_layers": (lambda: transformers.Qwen2Config(
        **COMMON, use_sliding_window=True, sliding_window=4, max_window_layers=1), (None, 4, 4)),
    "qwen3_layer_types": (lambda: transformers.Qwen3Config(
        **COMMON, head_dim=16, use_sliding_window=True, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]), (6, None, 6)),
    "qwen3_moe": (lambda: transformers.Qwen3MoeConfig(
        **COMMON, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, use_sliding_window=True, sliding_window=5), (5, 5, 5)),
}


def build(path, make_cfg, seed=0):
    return save_random(transformers, make_cfg(), str(path), seed)


def load(path, cfg=None) -> CausalLM:
    m = CausalLM(cfg or DecoderConfig.from_dir(str(path)), torch.float32, max_len=256)
    m.load(read_hf_dir(str(path)))
    return m


SEQ_LENS, PROMPTS = (30, 13, 22), (3, 10, 8)  # prompts below and above the window


def _check(hf, model):
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, 128, (n,), generator=g).tolist() for n in SEQ_LENS]
    got = _teacher_forced(model, seqs, list(PROMPTS))
    worst = 0.0
    for s, n, lps in zip(seqs, PROMPTS, got):
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([s])).logits[0].float(), -1)
        want = [lp[i - 1, s[i]].item() for i in range(n, len(s))]
        assert len(lps) == len(want)
        worst = max(worst, max(abs(a - b) for a, b in zip(lps, want)))
    return worst


@pytest.mark.parametrize("case", list(CASES))
def test_window_matches_transformers(tmp_path, case):
    make_cfg, windows = CASES[case]
    hf = build(tmp_path, make_cfg)
    cfg = DecoderConfig.from_dir(str(tmp_path))
    assert cfg.layer_windows == windows
    assert _check(hf, load(tmp_path)) <= 1e-5
    # the windows matter: full attention everywhere gives other logprobs on these lengths
    full = dataclasses.replace(cfg, layer_windows=(None,) * cfg.num_layers)
    assert _check(hf, load(tmp_path, full)) > 1e-3


def test_max_window_layers_without_layer_types(tmp_path):
    make_cfg, windows = CASES["qwen2_max_window_layers"]
    hf = build(tmp_path, make_cfg, seed=1)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    del cfg["layer_types"]  # an older config.json: transformers derives the types again
    path.write_text(json.dumps(cfg))
    assert DecoderConfig.from_dir(str(tmp_path)).layer_windows == windows
    assert _check(hf, load(tmp_path)) <= 1e-5


def test_window_off_without_use_sliding_window_and_context_not_capped(tmp_path):
    cfg = DecoderConfig.from_hf({**CASES["qwen3_layer_types"][0]().to_dict(), "use_sliding_window": False,
                                 "architectures": ["Qwen3ForCausalLM"]})
    assert cfg.layer_windows == (None, None, None)
    build(tmp_path, CASES["mistral"][0])
    state = build_state(str(tmp_path))
    try:
        assert state.engine.context_length == 256  # max_position_embeddings, not the window of 5
    finally:
        state.engine.shutdown()
