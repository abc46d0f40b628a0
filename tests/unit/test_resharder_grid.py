"""Resharder property grid: pushed tensors and HF exports equal transformers' checkpoint over
(heads, kv_heads, TP), (experts, EP, TP), tied/untied embeddings, qkv bias, QK-norm and odd
vocabularies.

Reference: tiny random models built WITH transformers (Llama GQA untied, Qwen2 qkv bias + tied,
Qwen3 q/k norm with head_dim != hidden/heads, Qwen3-MoE), saved by ``save_pretrained``. Each
(TP, EP) rank's parameters are cut the way megatron-core holds them: column/row-parallel blocks
by megatron-core's own splitter (``_initialize_affine_weight_cpu``), ``linear_fc1`` as
``[gate_r; up_r]`` per rank (megatron-core's ``swiglu`` halves the local output), experts on EP
rank ``e // (E/EP)`` (``MoELayer.local_expert_indices``), vocabulary padding rows filled with junk.
`test_megatron_core_reads_the_shards_as_hf_heads` checks that cut against megatron-core's
attention code. The real `Resharder.iter_buckets` and `hf_io.iter_hf_tensors` then run in-process
with the collectives answered from those rank tensors (an all-gather returns every TP rank's
shard in rank order, a broadcast the tensor its source rank holds); the buckets also cross both
wire formats ("megarl" direct buckets, SGLang's "flattened_bucket") through the real sender and
receiver packing. Megarl refuses kv_heads < TP (megatron-core would take TP a multiple of them):
`test_tp_refusals_against_megatron_core` pins which layouts preflight refuses and how.
"""
import concurrent.futures
import json
import queue
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_models import load_safetensors, save_random  # noqa: E402 - tests/dist, on sys.path (conftest)

from megarl.models import hf_io  # noqa: E402
from megarl.models.layouts import hf_to_full, pad_vocab  # noqa: E402
from megarl.protocol.hf_model import GATE_UP, VOCAB, model_args_from_config, param_table  # noqa: E402
from megarl.weights import resharder  # noqa: E402

DIVISIBLE_BY = 128  # model.make_vocab_size_divisible_by's default
BUCKET_BYTES = 6000  # small: a row's q/k/v (gate/up) straddle buckets
VOCABS = {4: 333, 8: 1000, 12: 1024}  # by head count: every vocabulary meets several TP sizes
DENSE = [(arch, h, kv, tp) for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
         for h in (4, 8, 12) for kv in (1, 2, 4, 8) if kv <= h and h % kv == 0
         for tp in (1, 2, 4, 8) if h % tp == 0]
MOE = [(e, ep, tp, tied) for e in (4, 8) for ep in (1, 2, 4) for tp in (1, 2) for tied in (False, True)
       if (e + ep + tp) % 2 == int(tied)]  # each (experts, EP, TP) once, tied and untied alternating


def refused(heads: int, kv: int, tp: int) -> bool:
    """What megarl's preflight refuses: TP must divide the heads and the KV heads."""
    return heads % tp != 0 or kv % tp != 0


# ----------------------------------------------------------------------------- the reference

_MODELS: dict = {}


def hf_config(arch: str, heads: int, kv: int, vocab: int, tied: bool = False, experts: int = 0):
    common = dict(vocab_size=vocab, num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv,
                  intermediate_size=64, max_position_embeddings=64, architectures=[arch])
    if arch == "LlamaForCausalLM":
        return transformers.LlamaConfig(hidden_size=96, tie_word_embeddings=tied, **common)
    if arch == "Qwen2ForCausalLM":
        return transformers.Qwen2Config(hidden_size=96, tie_word_embeddings=not tied, **common)
    if arch == "Qwen3ForCausalLM":  # head_dim 8: never hidden/heads (48/heads)
        return transformers.Qwen3Config(hidden_size=48, head_dim=8, tie_word_embeddings=tied, **common)
    return transformers.Qwen3MoeConfig(hidden_size=48, head_dim=8, num_experts=experts, num_experts_per_tok=2,
                                       moe_intermediate_size=24, norm_topk_prob=True,
                                       tie_word_embeddings=tied, **common)


def reference(tmp_path_factory, *key):
    """(ModelArgs from the saved config.json, transformers' saved tensors), one model per key."""
    if key not in _MODELS:
        out = str(tmp_path_factory.mktemp("hf"))
        cfg = hf_config(*key)
        save_random(transformers, cfg, out, seed=len(_MODELS))
        with open(f"{out}/config.json") as f:
            _MODELS[key] = model_args_from_config(json.load(f)), load_safetensors(out)
    return _MODELS[key]


# ----------------------------------------------------------------------------- megatron-core's shards

def megatron_split(full: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s block of a TP-split tensor, cut by megatron-core's own CPU initializer."""
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

    w = full if full.dim() == 2 else full[:, None]
    local = list(w.shape)
    local[dim] //= tp
    weight = torch.empty(local)
    _initialize_affine_weight_cpu(weight, w.shape[0], w.shape[1], local[dim], dim, lambda m: m.copy_(w),
                                  rank=rank, world_size=tp, skip_set_tensor_parallel_attributes=True)
    return weight.reshape(*full.shape[:dim], -1, *full.shape[dim + 1:])


def tp_shards(pmap, tensors, args, tp: int) -> list[torch.Tensor]:
    """Every TP rank's tensor of one dense row, in TP-rank order."""
    if pmap.kind == GATE_UP:  # [gate_r; up_r]: megatron-core's swiglu halves each rank's output
        return [torch.cat([megatron_split(t, 0, tp, r) for t in tensors]) for r in range(tp)]
    full = hf_to_full(pmap, tensors, args).clone()  # fused QKV; vocab rows padded
    if pmap.kind == VOCAB:
        full[args.vocab_size:] = 7.0  # what padding rows hold after training: anything
    if pmap.tp_dim is None:
        return [full] * tp
    return [megatron_split(full, pmap.tp_dim, tp, r) for r in range(tp)]


class Ranks:
    """The parameters of every (TP, EP) rank, and collectives answered from them: all_gather
    gives the TP shards of the gathered row, broadcast the expert its source EP rank holds
    (junk if that rank does not hold it, as a wrong owner would send)."""

    def __init__(self, args, sd, tp: int, ep: int):
        self.tp, self.ep, self.layer, self.pmap = tp, ep, None, None
        self.shards = {}  # data_ptr of TP rank 0's parameter -> every rank's shard
        self.experts = [{} for _ in range(ep)]  # EP rank -> {global row name: tensor}
        self.rank0 = []  # what local_params returns on TP = EP = 0
        per = args.num_experts // ep if args.num_experts else 0
        for layer, pmap in param_table(args):
            mcore, names = pmap.names(layer)
            tensors = [sd[n] for n in names]
            if pmap.expert is not None:  # whole experts: expert_tensor_parallel_size=1
                owner = pmap.expert // per  # MoELayer: local_expert_indices = ep_rank * per + i
                self.experts[owner][mcore] = hf_to_full(pmap, tensors, args).clone()
                if owner == 0:
                    self.rank0.append(hf_io.LocalParam(0, mcore, layer, pmap, self.experts[0][mcore]))
                continue
            shards = [s.clone() for s in tp_shards(pmap, tensors, args, tp)]
            self.shards[shards[0].data_ptr()] = shards
            self.rank0.append(hf_io.LocalParam(0, mcore, layer, pmap, shards[0]))
        self.ps = SimpleNamespace(tp=tp, tp_rank=0, tp_group=None, ep=ep, ep_rank=0, ep_group=None,
                                  ep_global_ranks=[r * tp for r in range(ep)], dp_rank=0, first_replica=True, expert_dp_rank=0,
                                  pp=1, pp_rank=0, is_pp_source=True, device=torch.device("cpu"))

    def gather_row(self, real):
        def gather(lp, pmap, *a):
            # rows come in table order: the layer of an expert another rank owns is the last one seen
            self.layer = lp.layer if lp is not None and lp.layer is not None else self.layer
            self.pmap = pmap
            return real(lp, pmap, *a)
        return gather

    def all_gather(self, out, tensor, group=None):
        for o, s in zip(out, self.shards[tensor.data_ptr()], strict=True):
            o.copy_(s)

    def broadcast(self, buf, src, group=None):
        held = self.experts[self.ps.ep_global_ranks.index(src)].get(self.pmap.names(self.layer)[0])
        buf.copy_(held if held is not None else torch.full_like(buf, float("nan")))


@pytest.fixture
def ranks(monkeypatch):
    """Builds `Ranks` and routes megarl's gather code to them."""
    def make(args, sd, tp, ep=1):
        r = Ranks(args, sd, tp, ep)
        monkeypatch.setattr(hf_io, "dist", SimpleNamespace(all_gather=r.all_gather, broadcast=r.broadcast))
        for mod in (hf_io, resharder):
            monkeypatch.setattr(mod, "local_params", lambda *a, **k: r.rank0)
            monkeypatch.setattr(mod, "gather_row", r.gather_row(_REAL_GATHER))
        return r
    return make


_REAL_GATHER = hf_io.gather_row


def engine(args, ps):
    config = SimpleNamespace(num_layers=args.num_layers, pipeline_model_parallel_size=1,
                             virtual_pipeline_model_parallel_size=None, num_layers_in_first_pipeline_stage=None,
                             num_layers_in_last_pipeline_stage=None)
    chunk = torch.nn.Module()
    chunk.config, chunk.w = config, torch.nn.Parameter(torch.zeros(1))
    return SimpleNamespace(args=args, tconfig=config, chunks=[chunk], ps=ps, use_te=False,
                           spec=SimpleNamespace(lora=None))


# ----------------------------------------------------------------------------- the checks

def assert_matches(got: dict, ref: dict, args, what: str) -> float:
    """Exact key set and shapes, values within 1e-6; returns the largest difference."""
    want = set(ref) - ({"lm_head.weight"} if args.tie_word_embeddings else set())
    missing, extra = sorted(want - set(got)), sorted(set(got) - want)
    assert not missing and not extra, f"{what}: missing {missing[:4]}, extra {extra[:4]}"
    worst = 0.0
    for name in sorted(want):
        assert tuple(got[name].shape) == tuple(ref[name].shape), f"{what}: {name} {tuple(got[name].shape)}"
        diff = (got[name].float() - ref[name].float()).abs().max().item()
        assert diff <= 1e-6, f"{what}: {name} differs from transformers' by {diff:.3g}"
        worst = max(worst, diff)
    return worst


def pushed(args, ps) -> tuple[dict, list]:
    rs = resharder.Resharder(engine(args, ps), bucket_bytes=BUCKET_BYTES)
    buckets = list(rs.iter_buckets())
    names = [n for b in buckets for n in b.names]
    assert len(names) == len(set(names)), "a tensor was pushed twice"
    return {n: t for b in buckets for n, t in zip(b.names, b.tensors)}, buckets


def exported(args, ps) -> dict:
    return dict(hf_io.iter_hf_tensors(engine(args, ps).chunks, args, ps))


def check_both(args, sd, ranks, tp, ep=1) -> list:
    r = ranks(args, sd, tp, ep)
    got, buckets = pushed(args, r.ps)
    assert_matches(got, sd, args, "push")
    assert_matches(exported(args, r.ps), sd, args, "export")
    return buckets


@pytest.mark.parametrize("arch, heads, kv, tp", DENSE,
                         ids=[f"{a[:5]}-h{h}-kv{kv}-tp{tp}{'-refused' if refused(h, kv, tp) else ''}"
                              for a, h, kv, tp in DENSE])
def test_dense_grid(tmp_path_factory, ranks, arch, heads, kv, tp):
    """Every (heads, kv_heads, TP) with TP dividing the heads; kv_heads < TP (megarl refuses it,
    megatron-core splits the fused rows contiguously) too, so lifting the refusal would not
    start at the resharder."""
    args, sd = reference(tmp_path_factory, arch, heads, kv, VOCABS[heads])
    args = pad_vocab(args, DIVISIBLE_BY, tp)
    assert args.mcore_vocab_size % (DIVISIBLE_BY * tp) == 0
    buckets = check_both(args, sd, ranks, tp)
    assert len(buckets) > 3


@pytest.mark.parametrize("experts, ep, tp, tied", MOE,
                         ids=[f"e{e}-ep{ep}-tp{tp}-{'tied' if t else 'untied'}" for e, ep, tp, t in MOE])
def test_moe_grid(tmp_path_factory, ranks, experts, ep, tp, tied):
    """Qwen3-MoE (QK-norm): experts with fused gate/up spread over EP ranks, attention over TP."""
    args, sd = reference(tmp_path_factory, "Qwen3MoeForCausalLM", 4, 2, 333, tied, experts)
    assert args.num_experts == experts and args.tie_word_embeddings == tied
    check_both(pad_vocab(args, DIVISIBLE_BY, tp), sd, ranks, tp, ep)




# ----------------------------------------------------------------------------- both wire formats

class Wire:
    """One trainer source and one server joined by a queue: the real `DistributedTransport.send`
    packs (per its wire format) and broadcasts into it, the real server `receive_broadcast`
    unpacks from it, in a thread, as the announce reaches the server."""

    def __init__(self, monkeypatch):
        import torch.distributed as dist
        from megarl.server.weights import WeightGroup, receive_broadcast

        self.sent, self.got = queue.Queue(), {}
        pool = concurrent.futures.ThreadPoolExecutor(1)
        real = dist.broadcast

        def broadcast(t, src=None, group=None, async_op=False, group_src=None):
            if group == "trainer":
                self.sent.put(t.clone())
            elif group == "server":
                t.copy_(self.sent.get(timeout=30))
            else:
                return real(t, src=src, group=group, async_op=async_op, group_src=group_src)
            return SimpleNamespace(wait=lambda: None, is_completed=lambda: True)

        monkeypatch.setattr(dist, "broadcast", broadcast)

        def receive(meta):
            out, _ = receive_broadcast(WeightGroup("server"), meta.names, meta.dtypes, meta.shapes,
                                       meta.load_format)
            self.got.update({n: t.clone() for n, t in out.items()})  # views of the group buffer otherwise
        # the transport's admin connection (a test double: no server process; the receive runs
        # megarl-server's own code): an announce starts the receive, which the broadcasts feed
        self.admin = SimpleNamespace(send=lambda msg: pool.submit(receive, msg.meta), addresses=["http://server"])


WIRES = [("LlamaForCausalLM", 8, 2, 4), ("Qwen2ForCausalLM", 12, 4, 2), ("Qwen3ForCausalLM", 4, 1, 1)]


@pytest.mark.parametrize("wire", ["megarl", "sglang"])
@pytest.mark.parametrize("arch, heads, kv, tp", WIRES,
                         ids=[f"{a[:5]}-h{h}-kv{kv}-tp{tp}" for a, h, kv, tp in WIRES])
def test_both_wire_formats_deliver_the_grid(tmp_path_factory, ranks, monkeypatch, wire, arch, heads, kv, tp):
    """The pushed buckets as a server receives them: megarl's "direct_bucket" (large tensors
    alone, small ones packed at 64-byte offsets) and SGLang's "flattened_bucket" (widest dtype
    first, back to back) carry the same names and values, bf16 buckets too. "Large" is lowered
    to 2 kB so the small grid models send both kinds, several of each per 64 kB bucket."""
    from megarl.protocol import wire as wire_protocol
    from megarl.weights.transports import DistributedTransport

    monkeypatch.setattr(wire_protocol, "DIRECT_MIN_BYTES", 2048)
    args, sd = reference(tmp_path_factory, arch, heads, kv, VOCABS[heads])
    args = pad_vocab(args, DIVISIBLE_BY, tp)
    link = Wire(monkeypatch)
    send = DistributedTransport(link.admin, "127.0.0.1", 30, "gloo", wire=wire)
    send.group, send.group_name = "trainer", "grid"
    r = ranks(args, sd, tp)
    for dtype in (torch.float32, torch.bfloat16):
        link.got.clear()
        for bucket in resharder.Resharder(engine(args, r.ps), bucket_bytes=1 << 16, dtype=dtype).iter_buckets():
            send.send(bucket, "v1")
        assert {t.dtype for t in link.got.values()} == {dtype}
        assert_matches(link.got, {n: t.to(dtype) for n, t in sd.items()}, args, f"{wire} wire, {dtype}")


# ----------------------------------------------------------------------------- megatron-core's reading

ANCHOR = [(h, kv, tp) for h in (4, 8) for kv in (1, 2, 4, 8) if kv <= h and h % kv == 0
          for tp in (1, 2, 4, 8) if h % tp == 0 and (kv % tp == 0 or tp % kv == 0)]


@pytest.mark.parametrize("heads, kv, tp", ANCHOR, ids=[f"h{h}-kv{kv}-tp{tp}" for h, kv, tp in ANCHOR])
def test_megatron_core_reads_the_shards_as_hf_heads(tmp_path_factory, monkeypatch, heads, kv, tp):
    """The cut used above is megatron-core's: its own ``get_query_key_value_tensors`` (kv < TP
    branch included: all-gather, then each rank's slice) on every rank's QKV shard gives HF's
    q/k/v heads of that rank, and its ``swiglu`` on each rank's fc1 shard HF's MLP activations."""
    import megatron.core.transformer.attention as mattn
    from megatron.core.fusions.fused_bias_swiglu import swiglu

    args, sd = reference(tmp_path_factory, "Qwen3ForCausalLM", heads, kv, VOCABS[heads])
    rows = {pmap.names(0)[0].split(".", 3)[-1]: pmap for layer, pmap in param_table(args) if layer == 0}
    hd, x = args.head_dim, torch.randn(3, 1, args.hidden_size, generator=torch.Generator().manual_seed(0))
    names = rows["self_attention.linear_qkv.weight"].names(0)[1]
    qkv = tp_shards(rows["self_attention.linear_qkv.weight"], [sd[n] for n in names], args, tp)
    outs = [x @ s.T for s in qkv]

    class Linear(torch.nn.Module):
        def __init__(self, rank):
            super().__init__()
            self.rank = rank

        def forward(self, h):
            return outs[self.rank], None

    monkeypatch.setattr(mattn, "all_gather_last_dim_from_tensor_parallel_region", lambda t: torch.cat(outs, -1))
    q_ref, k_ref, v_ref = (x @ sd[n].T for n in names)
    for r in range(tp):
        monkeypatch.setattr(mattn, "get_tensor_model_parallel_rank", lambda: r)
        few = kv < tp  # SelfAttention.__init__'s per-partition counts
        rank = SimpleNamespace(linear_qkv=Linear(r), world_size=tp, hidden_size_per_attention_head=hd,
                               num_query_groups_per_partition=1 if few else kv // tp,
                               num_attention_heads_per_partition=heads // kv if few else heads // tp,
                               config=SimpleNamespace(num_query_groups=kv, test_mode=False),
                               q_layernorm=None, k_layernorm=None)
        q, k, v = mattn.SelfAttention.get_query_key_value_tensors(rank, x)
        qh = heads // tp
        groups = [r // (tp // kv)] if few else range(r * kv // tp, (r + 1) * kv // tp)
        rows_of = lambda t, hs: torch.cat([t[..., h * hd:(h + 1) * hd] for h in hs], -1)  # noqa: E731
        # products of a shard and of the whole matrix: equal up to the BLAS kernel's summation
        # order, which differs between CPUs (one wrong head is off by O(1))
        same = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # noqa: E731
        same(q.reshape(3, 1, -1), q_ref[..., r * qh * hd:(r + 1) * qh * hd])
        same(k.reshape(3, 1, -1), rows_of(k_ref, groups))
        same(v.reshape(3, 1, -1), rows_of(v_ref, groups))
    fc1 = rows["mlp.linear_fc1.weight"]
    gate, up = (sd[n] for n in fc1.names(0)[1])
    act = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
    ffn = args.ffn_hidden_size // tp
    for r, s in enumerate(tp_shards(fc1, [gate, up], args, tp)):
        assert torch.allclose(swiglu(x @ s.T), act[..., r * ffn:(r + 1) * ffn], atol=1e-6)


# ----------------------------------------------------------------------------- what megarl refuses

REFUSALS = [(h, kv, tp) for h in (4, 8, 12) for kv in (1, 2, 3, 4, 6, 8) if kv <= h and h % kv == 0
            for tp in (2, 3, 4, 8)]


def megatron_accepts(heads: int, kv: int, tp: int) -> bool:
    from megatron.core.transformer import TransformerConfig

    try:
        TransformerConfig(num_layers=1, hidden_size=8 * heads, num_attention_heads=heads, num_query_groups=kv,
                          tensor_model_parallel_size=tp)
    except ValueError:
        return False
    return True


def test_tp_refusals_against_megatron_core(tmp_path):
    """Preflight (`check_against_model`, run by megarl-train and megarl-launch) refuses, in one
    line naming ``parallel.tp`` and the config.json field, every (heads, kv_heads, TP)
    megatron-core refuses, and further exactly kv_heads < TP (megatron-core takes TP a multiple of
    kv_heads; megarl's shard-refit plan holds whole query groups per trainer rank, and no training
    test runs it). megarl-convert's ``--tp`` check agrees."""
    from megarl.config import ConfigError, load_config
    from megarl.models.checks import check_against_model, check_layout
    from megarl.common.errors import ToolError
    from megarl.models.random_hf import tiny_config, write_random_hf

    beyond = []
    for heads, kv, tp in REFUSALS:
        hf = write_random_hf(str(tmp_path / f"h{heads}kv{kv}"), tiny_config(
            num_attention_heads=heads, num_key_value_heads=kv, hidden_size=8 * heads, intermediate_size=48,
            vocab_size=64, num_hidden_layers=1))
        over = [f"model.hf_path={hf}", "data.train_path=x", f"parallel.tp={tp}", f"parallel.world_size={tp}"]
        mcore = megatron_accepts(heads, kv, tp)
        if not refused(heads, kv, tp):
            assert mcore, (heads, kv, tp)
            check_against_model(load_config(None, over))
            continue
        field = "num_attention_heads" if heads % tp else "num_key_value_heads"
        with pytest.raises(ConfigError) as e:
            check_against_model(load_config(None, over))
        assert str(e.value) == f"parallel.tp: {tp} does not divide {field}={heads if heads % tp else kv}"
        with pytest.raises(ToolError, match=rf"^--tp {tp} does not divide {field}="):
            check_layout(model_args_from_config(tiny_config(num_attention_heads=heads, num_key_value_heads=kv,
                                                            hidden_size=8 * heads)), tp, 1)
        if mcore:
            beyond.append((heads, kv, tp))
    assert beyond and all(kv < tp and tp % kv == 0 for _, kv, tp in beyond)
    assert len(beyond) == sum(1 for h, kv, tp in REFUSALS if kv < tp and tp % kv == 0 and h % tp == 0)


def test_tp_must_divide_the_mlp(tmp_path):
    """A dense MLP TP does not divide: megatron-core's fc1/fc2 would stop at model build with a
    bare ``divide`` assertion; preflight names the field instead. MoE experts are never TP-split."""
    from megatron.core.utils import divide

    from megarl.config import ConfigError, load_config
    from megarl.models.checks import check_against_model
    from megarl.models.random_hf import tiny_config, write_random_hf

    with pytest.raises(AssertionError):
        divide(100, 8)  # what ColumnParallelLinear / RowParallelLinear compute per rank
    hf = write_random_hf(str(tmp_path / "m"), tiny_config(num_attention_heads=8, num_key_value_heads=8,
                                                          intermediate_size=100, num_hidden_layers=1))
    over = [f"model.hf_path={hf}", "data.train_path=x"]
    with pytest.raises(ConfigError) as e:
        check_against_model(load_config(None, over + ["parallel.tp=8", "parallel.world_size=8"]))
    assert str(e.value) == "parallel.tp: 8 does not divide intermediate_size=100"
    check_against_model(load_config(None, over + ["parallel.tp=4", "parallel.world_size=4"]))
