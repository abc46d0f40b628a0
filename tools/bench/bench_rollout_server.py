"""Throughput of the CPU rollout server over HTTP (and, optionally, HF `generate` on the same model).

    python tools/bench/bench_rollout_server.py [--model HF_DIR | --make-tiny] [--concurrency 1 16 64]
        [--new-tokens 128] [--threads 1] [--hf] [--url http://127.0.0.1:PORT]

Starts `megarl-server` on a free loopback port unless --url is given, sends `concurrency` requests
at once (prompt of --prompt-len tokens, ignore_eos, temperature 1), and reports generated tokens/s
and p50/p99 request latency. --hf also times `transformers` `generate` as one static batch of the
same size (the reference in docs/DESIGN: >= 0.5x of it at 64 concurrent).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import aiohttp

from megarl.common.net import LOOPBACK, free_port, http_url


def make_tiny(path: str, vocab: int = 64, hidden: int = 64, layers: int = 2) -> None:
    import torch
    from safetensors.torch import save_file

    heads, inter = 4, 4 * hidden
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
           "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": heads, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "max_position_embeddings": 1024, "tie_word_embeddings": False,
           "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "torch_dtype": "float32"}
    g = torch.Generator().manual_seed(0)
    sd = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g) * 0.5,
          "model.norm.weight": torch.ones(hidden), "lm_head.weight": torch.randn(vocab, hidden, generator=g) * 0.15}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n, shape in (("self_attn.q_proj", (hidden, hidden)), ("self_attn.k_proj", (hidden, hidden)),
                         ("self_attn.v_proj", (hidden, hidden)), ("self_attn.o_proj", (hidden, hidden)),
                         ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)),
                         ("mlp.down_proj", (hidden, inter))):
            sd[p + n + ".weight"] = torch.randn(*shape, generator=g) * 0.15
        sd[p + "input_layernorm.weight"] = torch.ones(hidden)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(sd, os.path.join(path, "model.safetensors"))


async def wait_ready(url: str, timeout: float = 60.0) -> float:
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as s:
        while time.perf_counter() - t0 < timeout:
            try:
                async with s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout}s")


async def run_load(url: str, n: int, prompt_len: int, new_tokens: int, vocab: int) -> dict:
    payload = lambda i: {  # noqa: E731
        "input_ids": [(7 * i + j) % (vocab - 3) + 3 for j in range(prompt_len)],
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True},
        "return_logprob": True,
    }
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def one(i):
            t = time.perf_counter()
            async with s.post(url + "/generate", json=payload(i)) as r:
                out = await r.json()
            return time.perf_counter() - t, len(out["output_ids"])

        await one(0)  # warm-up
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    lat = sorted(r[0] for r in res)
    toks = sum(r[1] for r in res)
    return {"concurrency": n, "tokens": toks, "wall_s": wall, "tok_per_s": toks / wall,
            "p50_s": lat[len(lat) // 2], "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))]}


def hf_generate(model_dir: str, n: int, prompt_len: int, new_tokens: int, vocab: int) -> dict:
    import torch
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids = torch.tensor([[(7 * i + j) % (vocab - 3) + 3 for j in range(prompt_len)] for i in range(n)])
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, pad_token_id=0)
    with torch.no_grad():
        m.generate(ids[:1], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        t0 = time.perf_counter()
        out = m.generate(ids, **kw)
        wall = time.perf_counter() - t0
    toks = (out.shape[1] - prompt_len) * n
    return {"concurrency": n, "tokens": toks, "wall_s": wall, "tok_per_s": toks / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF dir (default: a random 2-layer hidden-64 Llama)")
    ap.add_argument("--url", help="use a running server instead of starting one")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hf", action="store_true", help="also time transformers generate")
    args = ap.parse_args()
    model = args.model or os.path.join(tempfile.mkdtemp(), "tiny")
    if not args.model:
        make_tiny(model)
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    proc, url = None, args.url
    if url is None:
        port = free_port()
        url = http_url(LOOPBACK, port)
        cmd = [sys.executable, "-m", "megarl.server", "--model", model, "--port", str(port),
               "--threads", str(args.threads), "--log-level", "WARNING"]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd)
        asyncio.run(wait_ready(url))
        print(json.dumps({"server_ready_s": round(time.perf_counter() - t0, 2)}))
    try:
        for n in args.concurrency:
            r = asyncio.run(run_load(url, n, args.prompt_len, args.new_tokens, vocab))
            print(json.dumps({"engine": "megarl-server", **{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}}))
            if args.hf:
                import torch

                torch.set_num_threads(args.threads)
                h = hf_generate(model, n, args.prompt_len, args.new_tokens, vocab)
                print(json.dumps({"engine": "hf-generate", **{k: round(v, 4) if isinstance(v, float) else v for k, v in h.items()}}))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)


if __name__ == "__main__":
    main()
