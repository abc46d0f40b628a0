"""A latency model of megarl's weight push at real model sizes, from per-byte, per-tensor and
per-bucket costs. Predictions, not measurements: the GPU rows use documented link bandwidths
(docs/benchmarks.md cites them), only the CPU row's costs were measured (bench_weight_push.py).

    python tools/bench/push_latency_model.py

The push as megarl runs it (megarl/weights/push.py), per pipeline stage, one stage after the other:
the stage's TP group all-gathers each parameter (and the expert-parallel ranks hand their experts
to the source) over the node's NVLink, the stage source converts it, and a sender thread
broadcasts bucket k while bucket k+1 is gathered (pipelined: the stage costs the slower of the two
streams plus one bucket of the faster). Every server rank receives every byte (a server's TP ranks
slice what they need), and an NCCL broadcast's bus bandwidth does not fall with the number of
receivers (nccl-tests: broadcast busbw = algbw), so the server count and TP do not enter the byte
term; the link is the source GPU's NIC (servers on other nodes) or NVLink (same node).

    stage_bytes = bytes / pp
    gather = stage_bytes * ((1 - e) * (tp - 1) / tp + e * (ep - 1) / ep) / nvlink      e = expert share
    send   = stage_bytes / link + tensors / pp * per_tensor + buckets * per_bucket
    stage  = max(gather, send) + min(gather, send) / buckets                             (pipelined)
    total  = fixed + pp * stage          (or + stage when the stages push in parallel: not built yet)
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Model:
    name: str
    params: float  # parameters
    tensors: int  # HF tensors pushed (each expert's gate/up/down counted)
    expert_share: float  # fraction of the bytes in routed experts
    bytes_per_param: int = 2  # bf16 serving


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    server_tp: int = 1  # documented, not in the formula (see the module docstring)


@dataclass(frozen=True)
class Costs:
    link: float  # bytes/s of the source -> servers broadcast
    nvlink: float  # bytes/s of the TP/EP gather inside a node
    per_tensor: float  # s per tensor sent (launch + Python)
    per_bucket: float  # s per bucket (the HTTP announce round trip)
    fixed: float  # s per push (pause, flush, version, continue)
    bucket_bytes: float = 1 * 2**30
    link_efficiency: float = 1.0  # the share of the link's rate a large transfer reaches (``link`` is that)


def predict(model: Model, layout: Layout, costs: Costs, parallel_stages: bool = False) -> dict:
    """Seconds per push, with its parts (per stage for gather/send/stage)."""
    total_bytes = model.params * model.bytes_per_param
    stage_bytes = total_bytes / layout.pp
    buckets = max(1, math.ceil(stage_bytes / costs.bucket_bytes))
    e = model.expert_share
    gathered = (1 - e) * (layout.tp - 1) / layout.tp + e * (layout.ep - 1) / layout.ep
    gather = stage_bytes * gathered / costs.nvlink
    send = (stage_bytes / costs.link + model.tensors / layout.pp * costs.per_tensor
            + buckets * costs.per_bucket)
    stage = max(gather, send) + min(gather, send) / buckets
    total = costs.fixed + (stage if parallel_stages else layout.pp * stage)
    # the wire floor: every byte over the link at its full (not the reached) rate, nothing else
    floor = total_bytes / (costs.link / costs.link_efficiency)
    return {"bytes": total_bytes, "buckets": buckets, "gather_s": gather, "send_s": send,
            "stage_s": stage, "total_s": total, "gbps": total_bytes / total / GB, "floor_s": floor,
            "floor_share": floor / total}


# Parameter and tensor counts from the models' HF configs (bf16). Tensors per layer: dense Qwen3 =
# q, k, v, o, q_norm, k_norm, gate, up, down, 2 layer norms = 11; Qwen3-MoE = 8 attention/norm +
# router + 128 experts x 3 = 393; DeepSeek-V3 MLA = 9 attention/norm, 3 dense MLP layers (3 each)
# and 58 MoE layers of router + bias + 256 routed x 3 + 1 shared x 3 = 773; + embed, norm, head.
MODELS = {
    "Qwen3-8B": Model("Qwen3-8B", 8.19e9, 36 * 11 + 3, 0.0),
    "Qwen3-32B": Model("Qwen3-32B", 32.8e9, 64 * 11 + 3, 0.0),
    "Qwen3-30B-A3B": Model("Qwen3-30B-A3B", 30.5e9, 48 * 393 + 3, 0.95),
    "Qwen3-235B-A22B": Model("Qwen3-235B-A22B", 235e9, 94 * 393 + 3, 0.95),
    "DeepSeek-V3": Model("DeepSeek-V3", 671e9, 3 * 12 + 58 * (9 + 773) + 3, 0.96),
}

# Trainer layouts as published recipes use them (assumptions, listed in docs/benchmarks.md).
LAYOUTS = {
    "Qwen3-8B": Layout(tp=2, pp=1, ep=1, server_tp=1),
    "Qwen3-32B": Layout(tp=8, pp=1, ep=1, server_tp=4),
    "Qwen3-30B-A3B": Layout(tp=2, pp=1, ep=8, server_tp=4),
    "Qwen3-235B-A22B": Layout(tp=4, pp=4, ep=8, server_tp=8),
    "DeepSeek-V3": Layout(tp=8, pp=8, ep=32, server_tp=8),
}

# H100 SXM: NVLink 4 = 450 GB/s per direction, 80% reached by a large NCCL collective; one
# ConnectX-7 NDR port = 400 Gb/s = 50 GB/s, 90% reached. Per tensor: an NCCL launch (~20 us) plus
# megarl's Python per tensor (~30 us); per bucket: one HTTP announce (~2 ms, measured on loopback);
# fixed: the protocol's pause/flush/version/continue (~12 ms, measured on this machine).
H100_IB = Costs(link=0.9 * 50 * GB, nvlink=0.8 * 450 * GB, per_tensor=50e-6, per_bucket=2e-3, fixed=0.012,
                link_efficiency=0.9)
H100_NVLINK = Costs(link=0.8 * 450 * GB, nvlink=0.8 * 450 * GB, per_tensor=50e-6, per_bucket=2e-3,
                    fixed=0.012, link_efficiency=0.8)

# Published update times (the anchors), for the table's last column.
ANCHORS = {
    "Qwen3-30B-A3B": "verl checkpoint engine: 15.76 s -> 4.38 s",
    "DeepSeek-V3": "NeMo-RL shard-to-shard refit: ~2 s (H100)",
    "Qwen3-235B-A22B": "(none published; NeMo-RL: Qwen3.5-397B ~2 s; miles: GLM-5 744B 58.3 s -> 8.5 s)",
}


def table() -> list[str]:
    rows = ["| model (bf16) | GB | tensors | trainer TP/PP/EP, server TP | predicted: servers over IB "
            "(stages in turn / in parallel) | predicted: servers on NVLink | published |",
            "|---|---|---|---|---|---|---|"]
    for name, m in MODELS.items():
        lay = LAYOUTS[name]
        ib, ibp = predict(m, lay, H100_IB), predict(m, lay, H100_IB, parallel_stages=True)
        nv = predict(m, lay, H100_NVLINK)
        rows.append(f"| {name} | {ib['bytes'] / GB:.0f} | {m.tensors} | {lay.tp}/{lay.pp}/{lay.ep}, "
                    f"{lay.server_tp} | {ib['total_s']:.1f} s / {ibp['total_s']:.1f} s | {nv['total_s']:.2f} s "
                    f"| {ANCHORS.get(name, '-')} |")
    return rows


def floor_table() -> list[str]:
    """Model size x link: the predicted push, the rate it achieves and its share of the wire floor
    (every byte at the link's full rate, no per-tensor, per-bucket or fixed cost)."""
    rows = ["| model (bf16) | GB | link | predicted push | achieved GB/s | wire floor | % of the floor |",
            "|---|---|---|---|---|---|---|"]
    for name, m in MODELS.items():
        for link, costs in (("IB NDR, one port (50 GB/s)", H100_IB), ("NVLink 4 (450 GB/s)", H100_NVLINK)):
            r = predict(m, LAYOUTS[name], costs)
            rows.append(f"| {name} | {r['bytes'] / GB:.0f} | {link} | {r['total_s']:.2f} s | {r['gbps']:.0f} | "
                        f"{r['floor_s']:.2f} s | {100 * r['floor_share']:.0f}% |")
    return rows


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
                            ).parse_args(argv)
    print("\n".join(table()))
    print()
    print("\n".join(floor_table()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
