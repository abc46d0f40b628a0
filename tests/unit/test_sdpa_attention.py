"""model.attention=sdpa: megarl's SDPAttention (torch's fused kernel inside Megatron's
DotProductAttention module) gives Megatron's unfused attention's outputs and gradients within fp32
rounding: causal, GQA, a sliding window, a window on some layers only; with an explicit mask it
runs Megatron's own forward (bitwise equal). Real megatron-core modules, one gloo rank, in a
subprocess (Megatron's parallel state is process-global)."""
import json
import os
import subprocess
import sys

import pytest

from megarl.config import ConfigError, load_config

SCRIPT = r"""
import json, torch
from megarl.trainer import parallel
from megarl.common import compat
compat.quiet_megatron_warnings()
parallel.init_distributed()
parallel.init_model_parallel(1, 1)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megarl.mcore.sdpa import SDPAttention

def case(window=None, skip=None, layer=1, groups=2, mask=False):
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=groups,
                            kv_channels=16, window_size=window, window_attn_skip_freq=skip,
                            use_cpu_initialization=True, attention_dropout=0.0)
    ref = DotProductAttention(cfg, layer, AttnMaskType.causal, "self")
    new = SDPAttention(cfg, layer, AttnMaskType.causal, "self")
    g = torch.Generator().manual_seed(layer)
    s, b = 9, 3
    q = torch.randn(s, b, 4, 16, generator=g)
    k, v = (torch.randn(s, b, groups, 16, generator=g) for _ in range(2))
    m = torch.rand(b, 1, s, s, generator=g) > 0.7 if mask else None  # True = masked out
    outs = []
    for mod in (ref, new):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = mod(*leaves, m)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append([out] + [t.grad for t in leaves])
    return [float((a - c).abs().max()) for a, c in zip(*outs)], new.window

res = {
    "causal_gqa": case(),
    "causal_mha": case(groups=4),
    "window": case(window=(2, 0)),
    "window_skipped_layer": case(window=(2, 0), skip=[1, 0], layer=2),
    "window_on_layer": case(window=(2, 0), skip=[1, 0], layer=1),
    "explicit_mask": case(mask=True),
}
print(json.dumps(res))
"""


def test_sdpa_matches_megatron_unfused_attention():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (diffs, window) in res.items():
        # out, dq, dk, dv
        limit = 0.0 if name == "explicit_mask" else 2e-6
        assert max(diffs) <= limit, (name, diffs)
    assert res["window"][1] == [2, 0] and res["window_on_layer"][1] == [2, 0]
    assert res["window_skipped_layer"][1] is None and res["causal_gqa"][1] is None


def test_attention_config_field():
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base = [f"model.hf_path={repo}/examples/tiny/model", "data.train_path=x"]
    assert load_config(None, base).model.attention == "sdpa"
    assert load_config(None, base + ["model.attention=unfused"]).model.attention == "unfused"
    with pytest.raises(ConfigError, match="model.attention"):
        load_config(None, base + ["model.attention=flash"])
