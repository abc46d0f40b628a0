"""megarl-server's ``--device`` (and ``--context-length``, last test): the flag is validated at
startup, and the model, KV cache and sampler keep every tensor on the model's device. Without a
GPU the placement is checked on PyTorch's "meta" device, which refuses to mix with CPU tensors the way CUDA does (the GPU tier,
tests/gpu/test_gpu_push.py, runs the server on CUDA itself)."""
import pytest
import torch

from megarl.models.random_hf import tiny_config, write_random_hf
from megarl.server import LONGER_CONTEXT_ENV, check_device, context_limit
from megarl.server.model import CausalLM, DecoderConfig, KVCache
from megarl.server.sampling import BatchSampler, SamplingConfig


def test_check_device_accepts_cpu_and_refuses_what_is_not_here():
    assert check_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="expected cpu, cuda or cuda:N"):
        check_device("meta")
    with pytest.raises(ValueError, match="--device 'gpu0'"):
        check_device("gpu0")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=f"this machine has {n} CUDA device"):
        check_device(f"cuda:{n}")


def test_model_cache_and_sampler_stay_on_the_model_device(tmp_path):
    cfg = DecoderConfig.from_dir(write_random_hf(str(tmp_path), tiny_config()))
    model = CausalLM(cfg, torch.float32, max_len=64, device="meta")
    cache = KVCache(cfg, torch.float32, 4, 64, model.device)
    assert all(p.device.type == "meta" for p in model.params.values())
    with torch.inference_mode():
        logits = model.prefill([[1, 2, 3], [4, 5]], 0, cache)
        assert logits.shape == (2, cfg.vocab_size) and logits.device.type == "meta"
        logits = model.decode(torch.tensor([7, 8]), torch.tensor([3, 2]), cache)
        assert logits.device.type == "meta" and cache.k[0].device.type == "meta"
        cache.move([1], [0], 3)
        params = [SamplingConfig(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05), SamplingConfig(temperature=0)]
        tokens = BatchSampler()._sample_stochastic(logits / 0.7, params, [3, 4], [p.greedy for p in params])
        assert tokens.shape == (2,) and tokens.device.type == "meta"


def test_context_longer_than_the_model_needs_sglangs_variable(monkeypatch):
    """As SGLang: a --context-length past max_position_embeddings is refused unless
    SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN is 1/true (then it is used, with a warning)."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(max_position_embeddings=64)
    monkeypatch.delenv(LONGER_CONTEXT_ENV, raising=False)
    assert context_limit(cfg, None) == 64 and context_limit(cfg, 64) == 64 and context_limit(cfg, 16) == 16
    with pytest.raises(ValueError, match=r"--context-length 65 is longer than the model's "
                                         r"max_position_embeddings=64 .*SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"):
        context_limit(cfg, 65)
    monkeypatch.setenv(LONGER_CONTEXT_ENV, "0")
    with pytest.raises(ValueError):
        context_limit(cfg, 65)
    monkeypatch.setenv(LONGER_CONTEXT_ENV, "true")
    assert context_limit(cfg, 4096) == 4096
