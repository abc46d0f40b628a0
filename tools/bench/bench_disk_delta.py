"""weights.disk_delta (disk transport): bytes written and time of the delta format (XOR+zlib
records with CRC-32s, megarl.protocol.delta_format): "delta" = unchanged tensors as empty records,
changed ones raw (disk_delta=raw); "xor" = changed ones XOR+zlib (disk_delta=xor); against a full
safetensors write, for one push
after an update, trainer write + server read/rebuild. One process, no servers: the format's cost.

    python tools/bench/bench_disk_delta.py --hf examples/tiny/model            # the demo model
    python tools/bench/bench_disk_delta.py --hidden 1024 --layers 8 --vocab 16384   # 472 MiB fp32

The update is an Adam-like step on every tensor (p - lr * sign(noise), lr 1e-5: Adam's first step
moves each element by ~lr), or with --frozen, the same on all but the embedding and lm_head.
Files go to the page cache (no fsync, as the full write in the disk transport)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from megarl.protocol.delta_format import _bytes, decode, encode, MANIFEST  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf", default="")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--frozen", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="bench_delta_")
    hf = args.hf
    if not hf:
        from megarl.models.random_hf import tiny_config, write_random_hf

        hf = os.path.join(work, "hf")
        write_random_hf(hf, tiny_config(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                        vocab_size=args.vocab, intermediate_size=args.hidden * 11 // 4,
                                        num_attention_heads=args.hidden // 64,
                                        num_key_value_heads=max(1, args.hidden // 256)))
    from megarl.server.weights import read_hf_dir

    before = {n: t.float().contiguous() for n, t in read_hf_dir(hf).items()}
    g = torch.Generator().manual_seed(0)
    after = {n: t if args.frozen and ("embed" in n or "lm_head" in n)
             else t - args.lr * torch.randn(t.shape, generator=g).sign() for n, t in before.items()}
    base = {n: _bytes(t).copy() for n, t in before.items()}
    total = sum(t.numel() * 4 for t in after.values())
    rows = {"full": [], "delta": [], "xor": []}
    for r in range(args.repeats):
        d = os.path.join(work, f"full{r}")
        os.makedirs(d)
        t0 = time.perf_counter()
        save_file(after, os.path.join(d, "model.safetensors"))
        t1 = time.perf_counter()
        got = load_file(os.path.join(d, "model.safetensors"))
        t2 = time.perf_counter()
        assert all(torch.equal(got[n], after[n]) for n in after)
        rows["full"].append((os.path.getsize(os.path.join(d, "model.safetensors")), t1 - t0, t2 - t1))
        for k, xor in (("delta", False), ("xor", True)):
            d = os.path.join(work, f"{k}{r}")
            os.makedirs(d)
            t0 = time.perf_counter()
            with open(os.path.join(d, "stage0.bin"), "wb") as f:
                entries, _ = encode(sorted(after.items()), base, f, xor)
            with open(os.path.join(d, MANIFEST), "w") as f:
                json.dump({"base": "1", "version": "2", "tensors": entries}, f)
            t1 = time.perf_counter()
            got = decode(d, before, "1")
            t2 = time.perf_counter()
            assert all(torch.equal(got[n], after[n]) for n in after)
            rows[k].append((os.path.getsize(os.path.join(d, "stage0.bin")), t1 - t0, t2 - t1))
    print(f"model {hf}: {len(after)} tensors, {total / 2**20:.1f} MiB fp32; update lr={args.lr}"
          f"{' (embedding, lm_head frozen)' if args.frozen else ''}; median of {args.repeats}")
    for k, v in rows.items():
        nbytes = v[0][0]
        w = statistics.median(x[1] for x in v)
        rd = statistics.median(x[2] for x in v)
        print(f"  {k:5s}: {nbytes / 2**20:8.2f} MiB written ({nbytes / total:.3f} of raw), write {w:.3f} s, "
              f"server read{'' if k == 'full' else '+rebuild'} {rd:.3f} s, total {w + rd:.3f} s")


if __name__ == "__main__":
    main()
