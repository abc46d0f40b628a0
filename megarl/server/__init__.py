"""megarl's CPU rollout server: SGLang's HTTP protocol over a compact torch engine.

    megarl-server --model HF_DIR [--host 127.0.0.1 --port 30000] [--dtype float32|bfloat16]
                  [--api-key KEY] [--max-running-requests N] [--context-length N] [--threads N]
                  [--enable-return-routed-experts] [--device cpu|cuda|cuda:N] [--tp N]

It exists so that the whole RL loop (partial rollouts, weight pushes over gloo/disk/tensor) runs
and is tested on a CPU-only machine with the same client that drives real SGLang servers.
Modules: `model` (HF Llama/Mistral/Qwen2/Qwen3 forward + KV cache, sliding windows), `moe` (the
Qwen3-MoE / Qwen2-MoE expert MLP and its routing record), `sampling` (batched sampler),
`engine` (continuous batching thread), `tp` (``--tp N``: tensor-parallel ranks over gloo),
`protocol` (/generate JSON), `reward` (/classify: HF sequence-classification reward models),
`app` + `weight_routes` (HTTP endpoints, both built on `state`),
`weights` (safetensors dirs, tensor payloads, broadcast and shard-refit receive).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

log = logging.getLogger("megarl.server")


def load_tokenizer_or_none(model_dir: str):
    """The model dir's tokenizer (`megarl.common.tokenizer`: HF tokenizer.json or sentencepiece), or
    None when it has none (the server then takes and returns token ids only)."""
    from megarl.common.tokenizer import load_tokenizer

    try:
        return load_tokenizer(model_dir)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - a corrupt tokenizer file (sentencepiece: RuntimeError)
        raise ValueError(f"{model_dir}: cannot load the tokenizer "
                         f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})") from None


def check_device(device: str) -> str:
    """'cpu', 'cuda' or 'cuda:N' that this machine has; anything else is a ValueError."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"--device {device!r}: {e}") from None
    if dev.type == "cpu":
        return device
    if dev.type != "cuda":
        raise ValueError(f"--device {device!r}: expected cpu, cuda or cuda:N")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0 or (dev.index or 0) >= n:
        raise ValueError(f"--device {device!r}: this machine has {n} CUDA device(s)")
    return device


def build_state(
    model_dir: str,
    dtype: str = "float32",
    api_key: Optional[str] = None,
    max_running_requests: int = 128,
    context_length: Optional[int] = None,
    max_prefill_tokens: int = 8192,
    weight_version: str = "0",
    seed: Optional[int] = None,
    weights_roots: Optional[list[str]] = None,
    enable_return_routed_experts: bool = False,
    device: str = "cpu",
    tp_size: int = 1,
    tp_join=None,
):
    """Load config, weights and tokenizer; start the engine thread; return the app state.
    Bad input raises OSError/ValueError naming the file. ``weights_roots``: directories
    /update_weights_from_disk may read under (default: the model dir's parent, see
    `state.default_weights_roots`). ``enable_return_routed_experts``: requests may ask for the
    MoE routing (an MoE model only). ``device``: where weights, KV cache and compute live ("cpu",
    "cuda", "cuda:N"); a CUDA device on a machine without one is a ValueError. ``tp_size`` > 1:
    this process is the server TP leader (`megarl.server.tp`); ``tp_join()``, called once its
    weights are loaded, returns the `TPGroup` (every follower has joined)."""
    from megarl.server.engine import GenerationEngine
    from megarl.server.state import ServerState, default_weights_roots

    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"--model {model_dir}: no such directory")
    roots = [os.path.realpath(r) for r in weights_roots] if weights_roots else default_weights_roots(model_dir)
    for r in roots:
        if not os.path.isdir(r):
            raise FileNotFoundError(f"--weights-root {r}: no such directory")
    model, cfg, ctx = build_model(model_dir, dtype, context_length, device, 0, tp_size,
                                  enable_return_routed_experts)
    if tp_size > 1:
        model.tp = tp_join()
    tok = load_tokenizer_or_none(model_dir)
    if tok is not None and tok.vocab_size > cfg.vocab_size:
        # text prompts would encode to ids without an embedding row
        raise ValueError(f"{model_dir}: the tokenizer has {tok.vocab_size} tokens but config.json "
                         f"vocab_size={cfg.vocab_size}")
    engine = GenerationEngine(model, tok, max_running_requests, ctx, max_prefill_tokens, weight_version,
                              seed)
    engine.start()
    return ServerState(engine, model_dir, tok, model_dir if tok is not None else None, api_key,
                       weights_roots=tuple(dict.fromkeys([os.path.realpath(model_dir), *roots])),
                       return_routed_experts=enable_return_routed_experts)


LONGER_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


def context_limit(cfg, context_length: Optional[int]) -> int:
    """--context-length, or the model's max_position_embeddings. A longer one is refused, as
    SGLang refuses it (the same variable lets both allow it, with a warning): positions the model
    was never trained on give wrong tokens, and the KV cache is sized for it."""
    limit = cfg.max_position_embeddings
    if not context_length or context_length <= limit:
        return int(context_length or limit)
    where = f"--context-length {context_length} is longer than the model's max_position_embeddings={limit}"
    if os.environ.get(LONGER_CONTEXT_ENV, "").lower() not in ("1", "true"):
        raise ValueError(f"{where} (config.json); set {LONGER_CONTEXT_ENV}=1 to allow it (as with SGLang)")
    log.warning("%s; allowed by %s: outputs past %d tokens may be wrong", where, LONGER_CONTEXT_ENV, limit)
    return int(context_length)


def build_model(model_dir: str, dtype: str, context_length: Optional[int], device: str, tp_rank: int = 0,
                tp_size: int = 1, enable_return_routed_experts: bool = False):
    """(CausalLM holding TP rank ``tp_rank``'s slices, its full DecoderConfig, context length),
    weights loaded from ``model_dir``; every server TP rank builds its own."""
    from megarl.server.model import CausalLM, DecoderConfig
    from megarl.server.weights import parse_dtype, read_hf_dir

    cfg = DecoderConfig.from_dir(model_dir)  # errors name config.json and the field
    if enable_return_routed_experts and cfg.moe is None:
        raise ValueError(f"--enable-return-routed-experts: {cfg.architecture} has no experts")
    ctx = context_limit(cfg, context_length)
    if tp_size > 1 and cfg.num_labels:
        raise ValueError(f"--tp {tp_size}: a reward model ({cfg.architecture}) is served on one rank")
    if tp_size > 1 and check_device(device) != "cpu":
        raise ValueError(f"--tp {tp_size}: server tensor parallelism runs on CPU only (--device cpu)")
    model = CausalLM(cfg, parse_dtype(dtype), max_len=ctx, device=check_device(device), tp_rank=tp_rank,
                     tp_size=tp_size)
    tensors = read_hf_dir(model_dir)
    missing = model.missing(tensors)
    if missing:
        raise ValueError(f"{model_dir} lacks {len(missing)} tensors, e.g. {missing[:5]}")
    unknown = [n for n in tensors if n not in model.params and n != "lm_head.weight"]
    if unknown:
        log.warning("ignoring %d unexpected tensors, e.g. %s", len(unknown), unknown[:3])
    model.load({k: v for k, v in tensors.items() if k not in unknown})
    return model, cfg, ctx
