"""megarl-server's ``--device``: the flag is validated at startup, and the model, KV cache and
sampler keep every tensor on the model's device. Without a GPU the placement is checked on
PyTorch's "meta" device, which refuses to mix with CPU tensors the way CUDA does (the GPU tier,
tests/gpu/test_gpu_push.py, runs the server on CUDA itself)."""
import pytest
import torch

from megarl.models.random_hf import tiny_config, write_random_hf
from megarl.server import check_device
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
        tokens = BatchSampler()._sample_stochastic(logits, params, [3, 4], [p.greedy for p in params])
        assert tokens.shape == (2,) and tokens.device.type == "meta"
