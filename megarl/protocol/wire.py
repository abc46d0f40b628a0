"""The wire types: dataclasses that cross the process boundary between the rollout manager and the
inference servers (megarl-server imports this module and nothing else of the rollout side).

`ModelRequest` -> (client) -> SGLang-protocol /generate -> `ModelResponse`. A response is
token-aligned: ``output_tokens``, ``output_logprobs`` and ``output_versions`` have equal length;
``output_versions[i]`` is the policy (weight) version that produced token i, so one response can
span several versions when a weight update interrupted it (partial rollout). The admin messages
(`PauseRequest`, `WeightsUpdateGroup`, `DistributedWeightsMeta`, ...) serialize to the exact SGLang
JSON bodies with `to_json()`.

MoE routing (`RoutedExperts`): a /generate segment asked with ``return_routed_experts`` carries
``meta_info["routed_experts"]`` (base64 int32 [rows, layers, top_k], SGLang) and, from
megarl-server, ``meta_info["routed_expert_weights"]`` (base64 float32, same layout); rows =
prompt + output - 1, row j the routing of the forward that fed token j. A resubmitted segment
(prompt + tokens so far) recomputes the rows of its prefix; `RoutedExperts.extend` keeps the rows
already held and appends only the new ones, so row j always comes from the segment that sampled
token j + 1 (the version ``output_versions`` gives that token).
"""

from __future__ import annotations

import base64
import hashlib
import uuid
from dataclasses import asdict, dataclass, field
from typing import Literal, Optional

import numpy as np

StopReason = Literal["stop", "length", "abort", "tool_calls"]
PauseMode = Literal["abort", "retract", "in_place"]
SAFETENSORS_B64 = "safetensors_b64"  # megarl's /update_weights_from_tensor load_format (no pickle)
# /update_weights_from_tensor load_format of a same-host handover (`weights.transport: shm`): each
# serialized_named_tensors entry is a JSON manifest {"path", "tensors": [[name, dtype, shape,
# offset], ...]} of a file in SHM_DIR that the trainer wrote; the server maps it, no weight byte
# crosses a socket. Names start with SHM_PREFIX, the only files a server opens there.
SHARED_MEMORY = "megarl_shared_memory"
SHM_DIR = "/dev/shm"
SHM_PREFIX = "megarl-weights-"


@dataclass
class SamplingParams:
    """SGLang sampling params. temperature 0 = greedy; top_k <= 0 = off."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: Optional[list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    seed: Optional[int] = None

    def to_json(self, max_new_tokens: Optional[int] = None) -> dict:
        d = {
            "max_new_tokens": self.max_new_tokens if max_new_tokens is None else max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "ignore_eos": self.ignore_eos,
        }
        if self.stop:
            d["stop"] = list(self.stop)
        if self.stop_token_ids:
            d["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            d["sampling_seed"] = self.seed
        return d


@dataclass
class ModelRequest:
    """One sample to generate. Group sampling = n requests sharing a prompt (see agenerate_n)."""

    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    metadata: dict = field(default_factory=dict)


@dataclass
class RoutedExperts:
    """Per-token MoE routing of a sample: ``ids`` int32 [rows, layers, top_k] (expert ids, -1 on
    a layer without experts) and ``weights`` float32 in the same layout, or None when a segment
    came from a server that returns ids only (SGLang); row j = the position of token j."""

    ids: np.ndarray
    weights: Optional[np.ndarray] = None

    @property
    def rows(self) -> int:
        return int(self.ids.shape[0])

    @classmethod
    def from_meta(cls, meta: dict, num_layers: int, top_k: int) -> "RoutedExperts":
        """Decodes a /generate ``meta_info``; ValueError when the routes are absent or malformed."""
        if not isinstance(meta.get("routed_experts"), str):
            raise ValueError("meta_info has no routed_experts (start the server with "
                             "--enable-return-routed-experts and send return_routed_experts: true)")
        ids = _b64_rows(meta["routed_experts"], np.int32, num_layers, top_k, "routed_experts")
        weights = meta.get("routed_expert_weights")
        if weights is not None:
            weights = _b64_rows(weights, np.float32, num_layers, top_k, "routed_expert_weights")
            if weights.shape != ids.shape:
                raise ValueError(f"routed_expert_weights {weights.shape} != routed_experts {ids.shape}")
        return cls(ids, weights)

    def extend(self, seg: "RoutedExperts") -> "RoutedExperts":
        """The sample's routing after a resubmitted segment ``seg`` (its prompt is the sample so
        far, so it covers the same positions from 0): ``seg``'s rows wherever it has them. They
        are the routes the server held for those positions when it generated the segment's
        tokens - recomputed under the new weights when it prefilled the prefix again (megarl-server
        keeps no prefix cache; SGLang after a flush), the old ones when it reused cached KV - so
        the latest tokens, the ones a trainer at the new version gates, replay exactly what
        produced them. Keeping the earlier segment's rows for the prefix replayed the old
        version's routes under tokens computed on the new version's."""
        if seg.rows >= self.rows:
            return seg
        tail = slice(seg.rows, None)  # never seen: a segment shorter than the sample so far
        weights = None
        if self.weights is not None and seg.weights is not None:
            weights = np.concatenate([seg.weights, self.weights[tail]])
        return RoutedExperts(np.concatenate([seg.ids, self.ids[tail]]), weights)


def _b64_rows(text, dtype, num_layers: int, top_k: int, what: str) -> np.ndarray:
    try:
        raw = base64.b64decode(text, validate=True)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{what} is not base64: {e}") from None
    item = np.dtype(dtype).newbyteorder("<")
    per_row = item.itemsize * num_layers * top_k
    if len(raw) % per_row:
        raise ValueError(f"{what}: {len(raw)} bytes is not a whole number of [{num_layers}, {top_k}] rows")
    return np.frombuffer(raw, dtype=item).astype(dtype).reshape(-1, num_layers, top_k)


@dataclass
class ModelResponse:
    """A finished sample; output_* lists are token-aligned (one entry per generated token)."""

    input_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    stop_reason: StopReason = "stop"
    stop_matched: Optional[object] = None  # the stop token id / string, when stop_reason == "stop"
    text: Optional[str] = None  # last segment's text (None without a server tokenizer)
    rid: str = ""
    latency: float = 0.0  # seconds from submit to the final segment
    num_segments: int = 1  # /generate calls made (> 1 after interruptions)
    server: str = ""  # address of the server that produced the last segment
    routed_experts: Optional[RoutedExperts] = None  # MoE routing, when the client asked for it

    @property
    def input_len(self) -> int:
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)


@dataclass
class PauseRequest:
    mode: PauseMode = "abort"

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class WeightsUpdateGroup:
    """/init_weights_update_group body; rank_offset is filled per server by the client."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"
    rank_offset: int = 1
    # megarl-server: the group's collective timeout (a receive a dead peer never feeds ends then
    # instead of after 300 s); not sent when None (SGLang's body has no such field)
    timeout: Optional[float] = None

    def to_json(self) -> dict:
        d = asdict(self)
        if d["timeout"] is None:
            d.pop("timeout")
        return d


def _without_unset_version(msg) -> dict:
    """The message's JSON body; ``weight_version`` is left out when unset (server keeps its own)."""
    d = asdict(msg)
    if d.get("weight_version") is None:
        d.pop("weight_version", None)
    return d


@dataclass
class DistributedWeightsMeta:
    """One announced bucket for /update_weights_from_distributed (HF names, broadcast order).
    ``load_format`` "flattened_bucket": the whole bucket arrives as ONE broadcast of bytes laid out
    by `flat_layout` (megarl-server; one collective instead of one per tensor, whose fixed latency
    dominated small models); "direct_bucket": `direct_split` - each large tensor in a broadcast of
    its own, straight into the server's parameter storage, then the small ones packed in one
    flattened broadcast (megarl-server; what the trainer sends); None: one broadcast per tensor
    (SGLang's default)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    weight_version: Optional[str] = None
    load_format: Optional[str] = None

    def to_json(self) -> dict:
        d = _without_unset_version(self)
        if d.get("load_format") is None:
            d.pop("load_format", None)
        return d


FLATTENED_BUCKET = "flattened_bucket"
_ITEMSIZE = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8, "double": 8,
             "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
FLAT_ALIGN = 8  # every tensor starts on an 8-byte boundary, so each slice views as its dtype
DIRECT_BUCKET = "direct_bucket"
# A tensor of at least this many bytes travels alone, from the trainer's tensor into the server's
# parameter: a gloo broadcast's fixed cost (0.3-1.5 ms on loopback, docs/benchmarks.md) is about what
# packing and unpacking 1 MiB costs (two memcpys at ~1-5 GiB/s), so above it a copy costs more.
DIRECT_MIN_BYTES = 1 << 20


def nbytes_of(dtype: str, shape) -> int:
    n = _ITEMSIZE[str(dtype).replace("torch.", "")]
    for d in shape:
        n *= int(d)
    return n


def direct_split(dtypes: list[str], shapes: list[list[int]]) -> tuple[list[int], list[int]]:
    """A "direct_bucket" on the wire: indices of the tensors broadcast one by one, in announced
    order (those of >= `DIRECT_MIN_BYTES`), and of the rest, which follow in ONE broadcast laid
    out by `flat_layout` of their dtypes/shapes (none when the list is empty). Both sides derive
    the same collective sequence from the announce alone."""
    direct = [i for i, (d, s) in enumerate(zip(dtypes, shapes)) if nbytes_of(d, s) >= DIRECT_MIN_BYTES]
    chosen = set(direct)
    return direct, [i for i in range(len(dtypes)) if i not in chosen]


def flat_layout(dtypes: list[str], shapes: list[list[int]], align: int = FLAT_ALIGN
                ) -> tuple[list[tuple[int, int]], int]:
    """(offset, nbytes) of each tensor in a flattened bucket, and the bucket's total bytes. Each
    tensor starts on an ``align``-byte boundary: `FLAT_ALIGN` for the packed part of a
    "direct_bucket"; 1 for SGLang's "flattened_bucket" (tensors back to back), where every offset
    must still be a multiple of its dtype's size (SGLang refuses the bucket otherwise):
    `sglang_flat_order` arranges a bucket so that it is."""
    out, at = [], 0
    for dt, shape in zip(dtypes, shapes):
        n = nbytes_of(dt, shape)
        if at % _ITEMSIZE[str(dt).replace("torch.", "")]:
            raise ValueError(f"flattened bucket: tensor {len(out)} ({dt}) would start at byte {at}, "
                             "not a multiple of its dtype's size")
        out.append((at, n))
        at += -(-n // align) * align
    return out, at


def sglang_flat_order(dtypes: list[str]) -> list[int]:
    """An order of a bucket's tensors in which SGLang's back-to-back "flattened_bucket" layout
    keeps every tensor aligned to its dtype's size: widest dtypes first (sizes are powers of two,
    so every offset after a run of wider tensors is a multiple of the narrower ones' size)."""
    return sorted(range(len(dtypes)), key=lambda i: -_ITEMSIZE[str(dtypes[i]).replace("torch.", "")])


# ---- what a server is ------------------------------------------------------------------------------
# megarl-server's additions to SGLang 0.5.x's protocol, listed in its /model_info under
# "megarl_extensions". A server that lists none (real SGLang) is sent SGLang's own endpoints and
# load formats only; the rollout side chooses the wire from these (`megarl.config.server_wire`).
EXT_DIRECT_BUCKET = "direct_bucket"  # /update_weights_from_distributed load_format "direct_bucket"
EXT_SAFETENSORS = SAFETENSORS_B64  # /update_weights_from_tensor with safetensors payloads
EXT_SHARD_REFIT = "shard_refit"  # load_format "shard_refit" with server_tp_ranks
EXT_CHECKSUM = "weights_checksum"  # /weights_checksum
EXT_DISK_DELTA = "disk_delta"  # /update_weights_from_disk of delta records
EXT_SHARED_MEMORY = SHARED_MEMORY  # /update_weights_from_tensor from a file in SHM_DIR (same host)
EXT_SLEEP = "memory_occupation"  # /release_memory_occupation, /resume_memory_occupation (SGLang has them)
EXT_THREADS = "set_threads"  # /set_threads {threads}: generation's torch threads, changed while serving
MEGARL_EXTENSIONS = (EXT_DIRECT_BUCKET, EXT_SAFETENSORS, EXT_SHARD_REFIT, EXT_CHECKSUM, EXT_DISK_DELTA,
                     EXT_SHARED_MEMORY, EXT_SLEEP, EXT_THREADS)


def server_extensions(model_info: dict) -> frozenset:
    """The extensions a /model_info answer advertises (empty: SGLang's protocol only). Unknown
    names are kept: a newer megarl-server may offer more than this client uses."""
    got = model_info.get("megarl_extensions") or []
    if not isinstance(got, list) or not all(isinstance(x, str) for x in got):
        raise ValueError(f"/model_info megarl_extensions: expected a list of names, got {got!r}")
    return frozenset(got)


@dataclass
class TensorWeightsUpdate:
    """/update_weights_from_tensor body; build it with `megarl.protocol.tensor_wire.tensor_update`
    (safetensors for megarl-server, SGLang's format for real SGLang: ``load_format`` None)."""

    serialized_named_tensors: list[str]
    load_format: Optional[str] = SAFETENSORS_B64
    flush_cache: bool = True
    weight_version: Optional[str] = None

    def to_json(self) -> dict:
        return _without_unset_version(self)


@dataclass
class DiskWeightsUpdate:
    model_path: str
    weight_version: Optional[str] = None

    def to_json(self) -> dict:
        return _without_unset_version(self)


@dataclass
class WeightsChecksumRequest:
    """/weights_checksum body (a megarl-server extension; real SGLang has no such endpoint): the
    server answers ``{"success": true, "checksums": {name: hex}}`` with `tensor_digest` of each
    named tensor as it holds it, cast to ``dtypes[i]`` (the dtype the trainer pushed it in; a
    server holding fewer bits than were pushed cannot match). No tensor data crosses HTTP."""

    names: list[str]
    dtypes: list[str]

    def to_json(self) -> dict:
        return asdict(self)


def tensor_digest(t, dtype=None) -> str:
    """sha256 (hex) of a tensor's bytes, row-major, in ``dtype`` (default its own): the weight
    checksum both the trainer (what it pushed) and megarl-server (what it holds) compute. Equal
    digests mean bitwise-equal tensors; shape is checked by name on the server's side."""
    import torch

    x = t.detach()
    if dtype is not None and x.dtype != dtype:
        x = x.to(dtype)
    flat = x.contiguous().reshape(-1).view(torch.uint8)
    h = hashlib.sha256()
    # hashed through 4 MiB copies: handing a parameter's own memory to numpy would mark its storage
    # not resizable for good, and a sleeping server resizes it to release it (server/memory.py)
    for chunk in flat.split(4 << 20):
        h.update(chunk.cpu().clone().numpy())  # a CUDA server's weights too
    return h.hexdigest()


def policy_adapter(version: int) -> str:
    """The name the policy's LoRA adapter of ``version`` is loaded under on SGLang servers
    (megarl-train's pusher loads it; the rollout manager's requests select it as ``lora_path``)."""
    return f"megarl-policy-v{int(version)}"


@dataclass
class LoRAAdapterLoad:
    """/load_lora_adapter body (SGLang 0.5.x): the PEFT adapter directory ``lora_path``
    (adapter_config.json + adapter_model.safetensors) is loaded under ``lora_name``; a generate
    request then selects it with ``"lora_path": lora_name`` (SGLang needs --enable-lora). megarl-server
    merges the adapter into its weights (one adapter at a time, `megarl.server.lora`)."""

    lora_name: str
    lora_path: str
    pinned: bool = False

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class LoRAAdapterUnload:
    """/unload_lora_adapter body (SGLang 0.5.x)."""

    lora_name: str

    def to_json(self) -> dict:
        return asdict(self)
