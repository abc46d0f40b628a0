"""Fused-QKV (GQA grouping) and gate/up transforms against hand-built layouts."""
import torch

from megarl.models import transforms as T
from megarl.protocol.hf_model import get_architecture, read_model_args


def test_merge_qkv_group_layout():
    heads, groups, d, hidden = 4, 2, 3, 5
    q = torch.arange(heads * d * hidden, dtype=torch.float32).reshape(heads * d, hidden)
    k = -torch.arange(groups * d * hidden, dtype=torch.float32).reshape(groups * d, hidden) - 1
    v = 1000 + torch.arange(groups * d * hidden, dtype=torch.float32).reshape(groups * d, hidden)
    fused = T.merge_qkv(q, k, v, heads, groups)
    # group 0: q heads 0,1 then k0 then v0; group 1: q heads 2,3 then k1 then v1
    expect = torch.cat([q[0:6], k[0:3], v[0:3], q[6:12], k[3:6], v[3:6]])
    assert torch.equal(fused, expect)
    assert all(torch.equal(a, b) for a, b in zip(T.split_qkv(fused, heads, groups), (q, k, v)))


def test_qkv_bias_and_tp_shard_is_contiguous_groups():
    heads, groups, d = 8, 4, 2
    q, k, v = torch.randn(heads * d), torch.randn(groups * d), torch.randn(groups * d)
    fused = T.merge_qkv(q, k, v, heads, groups)
    shard1 = T.shard(fused, 0, 2, 1)  # TP rank 1 owns groups 2, 3
    q1, k1, v1 = T.split_qkv(shard1, heads // 2, groups // 2)
    assert torch.equal(q1, q[8:]) and torch.equal(k1, k[4:]) and torch.equal(v1, v[4:])


def test_gate_up_shards():
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    shards = [T.gate_up_to_shard(gate, up, 2, r) for r in range(2)]
    assert torch.equal(shards[0], torch.cat([gate[:4], up[:4]]))
    assert torch.equal(shards[1], torch.cat([gate[4:], up[4:]]))
    g, u = T.shards_to_gate_up(shards)
    assert torch.equal(g, gate) and torch.equal(u, up)


def test_unknown_architecture_lists_supported(tmp_path):
    import json
    import pytest
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError) as e:
        read_model_args(str(tmp_path))
    assert "'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM, MistralForCausalLM, " \
           "Qwen2ForCausalLM, Qwen3ForCausalLM" in str(e.value)
    assert get_architecture("Qwen2ForCausalLM").qkv_bias


def test_rope_theta_from_transformers5_rope_parameters(tmp_path):
    from megarl.models.random_hf import tiny_config, write_random_hf

    cfg = tiny_config()
    del cfg["rope_theta"]
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    assert read_model_args(write_random_hf(str(tmp_path / "a"), cfg)).rope_theta == 500000.0
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}
    args = read_model_args(write_random_hf(str(tmp_path / "b"), cfg))
    assert args.rope_scaling_factor == 8.0 and args.rope_theta == 500000.0


def test_layouts_round_trip_every_row_full_and_sharded(tmp_path):
    """Per table row: HF -> full Megatron -> HF and HF -> TP shards -> HF are identities, and the
    full tensors have the dist-checkpoint shapes (one layer of a stacked key)."""
    from megarl.models import layouts as L
    from megarl.models.random_hf import tiny_config, write_random_hf
    from megarl.protocol.hf_model import param_table
    from safetensors.torch import load_file

    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        hf_dir = write_random_hf(str(tmp_path / arch), tiny_config(arch))
        args, hf = read_model_args(hf_dir), load_file(str(tmp_path / arch / "model.safetensors"))
        assert {n: tuple(t.shape) for n, t in hf.items()} == L.hf_shapes(args)
        stacked = L.mcore_shapes(args)
        for layer, pmap in param_table(args):
            names = pmap.names(layer)[1]
            full = L.hf_to_full(pmap, [hf[n] for n in names], args)
            want = stacked[L.mcore_key(pmap)]
            lead = (layer is not None) + (pmap.expert is not None)  # stacked layer / expert axes
            assert tuple(full.shape) == want[lead:]
            assert all(torch.equal(a, hf[n]) for a, n in zip(L.full_to_hf(pmap, full, args), names))
            shards = [L.hf_to_shard(pmap, [hf[n] for n in names], args, 2, r) for r in range(2)]
            assert all(torch.equal(a, hf[n]) for a, n in zip(L.shards_to_hf(pmap, shards, args), names))


def test_group_by_bytes_caps_and_boundaries():
    from megarl.models.layouts import group_by_bytes, safetensors_file_names

    items = [("a", 4), ("a", 4), ("a", 9), ("b", 1), ("b", 3), ("b", 4)]
    groups = group_by_bytes(items, lambda x: x[1], 8, boundary=lambda x: x[0])
    assert groups == [[("a", 4), ("a", 4)], [("a", 9)], [("b", 1), ("b", 3), ("b", 4)]]
    assert group_by_bytes(items, lambda x: x[1], 100) == [items]
    assert safetensors_file_names(1) == ["model.safetensors"]
    assert safetensors_file_names(2) == ["model-00001-of-00002.safetensors",
                                         "model-00002-of-00002.safetensors"]


def test_vocab_rows_pad_on_import_and_strip_on_export(tmp_path):
    """Embedding / output rows: Megatron holds padded_vocab_size rows (zeros beyond the vocab),
    every way back to HF gives exactly the original tensor."""
    from megarl.models import layouts as L
    from megarl.models.random_hf import tiny_config, write_random_hf
    from megarl.protocol.hf_model import param_table
    from safetensors.torch import load_file

    hf_dir = write_random_hf(str(tmp_path), tiny_config(vocab_size=333))
    args = L.pad_vocab(read_model_args(hf_dir), 128, 2)
    assert (args.vocab_size, args.mcore_vocab_size) == (333, 512)
    assert L.padded_vocab_size(333, 128, 1) == 384 and L.padded_vocab_size(256, 128, 2) == 256
    hf = load_file(str(tmp_path / "model.safetensors"))
    assert L.mcore_shapes(args)["embedding.word_embeddings.weight"] == (512, 64)
    assert L.hf_shapes(args)["model.embed_tokens.weight"] == (333, 64)
    for layer, pmap in param_table(args):
        if pmap.kind != "vocab":
            continue
        name = pmap.names(layer)[1][0]
        full = L.hf_to_full(pmap, [hf[name]], args)
        assert full.shape == (512, 64) and torch.equal(full[:333], hf[name]) and not full[333:].any()
        assert torch.equal(L.full_to_hf(pmap, full, args)[0], hf[name])
        shards = [L.hf_to_shard(pmap, [hf[name]], args, 2, r) for r in range(2)]
        assert [tuple(s.shape) for s in shards] == [(256, 64), (256, 64)]
        assert torch.equal(L.shards_to_hf(pmap, shards, args)[0], hf[name])


def test_sliding_window_is_read_like_transformers(tmp_path):
    """Mistral windows every layer; Qwen2/3 window only with use_sliding_window, from
    max_window_layers on; an explicit layer_types list decides; no window -> None. The builder
    turns it into Megatron's window_size=(W-1, 0) (+ a per-layer list when not all layers)."""
    import json

    from megarl.models import builder
    from megarl.models.random_hf import tiny_config

    def args_of(name, arch, **kw):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(tiny_config(arch, **kw)))
        return read_model_args(str(d))

    m = args_of("m", "MistralForCausalLM", sliding_window=4)
    assert (m.sliding_window, m.window_layers) == (4, None)
    assert args_of("m0", "MistralForCausalLM", sliding_window=None).sliding_window is None
    q = args_of("q", "Qwen2ForCausalLM", sliding_window=8, use_sliding_window=True, max_window_layers=2)
    assert (q.sliding_window, q.window_layers) == (8, (False, False, True, True))
    off = args_of("q0", "Qwen2ForCausalLM", sliding_window=131072, use_sliding_window=False)
    assert off.sliding_window is None and off.window_layers is None  # Qwen2.5 configs look like this
    t = args_of("t", "Qwen3ForCausalLM", sliding_window=8, use_sliding_window=True, layer_types=[
        "full_attention", "sliding_attention", "full_attention", "sliding_attention"])
    assert t.window_layers == (False, True, False, True)
    assert builder.transformer_config(m, tp=1, pp=1).window_size == (3, 0)
    cfg = builder.transformer_config(q, tp=1, pp=1)
    assert cfg.window_size == (7, 0) and cfg.window_attn_skip_freq == [0, 0, 1, 1]
    assert builder.transformer_config(off, tp=1, pp=1).window_size is None


def test_qwen3_moe_table_and_refusals(tmp_path):
    """Router + 4 experts x (fc1, fc2) per layer, global expert names; dense layers in an MoE
    model, TP > 1, and an EP that does not divide the experts are refused naming the field."""
    import json

    import pytest

    from megarl.models import builder, layouts as L
    from megarl.models.random_hf import tiny_config, write_random_hf
    from megarl.protocol.hf_model import param_table

    args = read_model_args(write_random_hf(str(tmp_path / "m"), tiny_config("Qwen3MoeForCausalLM")))
    assert (args.num_experts, args.moe_topk, args.moe_ffn_hidden_size, args.moe_norm_topk) == (4, 2, 32, True)
    rows = [(layer, p) for layer, p in param_table(args) if layer == 1 and ".mlp." in p.mcore]
    assert [p.names(1)[0] for _, p in rows[:3]] == [
        "decoder.layers.1.mlp.router.weight", "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight",
        "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"]
    assert rows[-1][1].names(1)[1] == ("model.layers.1.mlp.experts.3.down_proj.weight",) and len(rows) == 9
    shapes = L.mcore_shapes(args)
    assert shapes["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (4, 4, 64, 64)
    assert L.hf_shapes(args)["model.layers.0.mlp.gate.weight"] == (4, 64)
    cfg = builder.transformer_config(args, tp=1, pp=1, ep=2)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_router_pre_softmax) == (4, 2, False)
    assert (cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff) == ("none", 0.0, None)
    assert not cfg.moe_grouped_gemm  # local spec: SequentialMLP
    for kw, msg in [(dict(tp=2, pp=1), "parallel.tp: MoE models .* need parallel.sequence_parallel=true with "
                                       r"the TE spec \(model.spec=te, GPU\)"),
                    (dict(tp=2, pp=1, sequence_parallel=True), "parallel.sequence_parallel: needs the Transformer"),
                    (dict(tp=1, pp=1, ep=3), "parallel.ep: 3 does not divide num_experts=4")]:
        with pytest.raises(ValueError, match=f"^{msg}"):
            builder.transformer_config(args, **kw)
    dense = read_model_args(write_random_hf(str(tmp_path / "d"), tiny_config()))
    with pytest.raises(ValueError, match="^parallel.ep: 2 > 1 needs an MoE model"):
        builder.transformer_config(dense, tp=1, pp=1, ep=2)
    cfg_path = tmp_path / "m" / "config.json"
    hf = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps(dict(hf, mlp_only_layers=[0])))
    with pytest.raises(ValueError, match="mlp_only_layers / decoder_sparse_step"):
        read_model_args(str(tmp_path / "m"))


def test_moe_training_options_reach_megatron(tmp_path):
    """moe.aux_loss_coeff / z_loss_coeff become megatron-core's aux_loss balancing and z-loss; on
    the TE spec the experts run as a grouped GEMM and TP > 1 is accepted with sequence parallelism
    (config level: building that model needs TE and a GPU, tests/gpu)."""
    from megarl.models import builder
    from megarl.config.moe import MoEConfig
    from megarl.models.random_hf import tiny_config, write_random_hf

    args = read_model_args(write_random_hf(str(tmp_path), tiny_config("Qwen3MoeForCausalLM")))
    cfg = builder.transformer_config(args, tp=1, pp=1, moe=MoEConfig(aux_loss_coeff=0.01, z_loss_coeff=0.001))
    assert (cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff) == (
        "aux_loss", 0.01, 0.001)
    te = builder.transformer_config(args, tp=2, pp=1, sequence_parallel=True, use_te=True)
    assert te.moe_grouped_gemm and te.sequence_parallel and te.expert_tensor_parallel_size == 1
    assert te.tensor_model_parallel_size == 2
    spec = builder.layer_spec(args, use_te=False)
    assert spec.submodules.mlp.submodules.experts.module.__name__ == "SequentialMLP"


def test_qwen3_moe_defaults_and_windows_match_transformers(tmp_path):
    """What read_model_args takes from a Qwen3-MoE config.json equals what transformers'
    Qwen3MoeConfig makes of it: norm_topk_prob absent -> False; the window on every layer exactly
    when use_sliding_window (layer_types and max_window_layers are not read by Qwen3-MoE)."""
    import json

    import pytest

    transformers = pytest.importorskip("transformers")
    from megarl.models.random_hf import tiny_config

    base = tiny_config("Qwen3MoeForCausalLM")
    del base["norm_topk_prob"]
    cases = [{}, {"norm_topk_prob": True},
             {"use_sliding_window": True, "sliding_window": 8},
             {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
             {"use_sliding_window": True, "sliding_window": 8,
              "layer_types": ["full_attention", "sliding_attention"] * 2},
             {"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 0}]
    for i, extra in enumerate(cases):
        hf = dict(base, **extra)
        d = tmp_path / str(i)
        d.mkdir()
        (d / "config.json").write_text(json.dumps(hf))
        args = read_model_args(str(d))
        ref = transformers.Qwen3MoeConfig(**{k: v for k, v in hf.items() if k != "architectures"})
        assert args.moe_norm_topk == ref.norm_topk_prob, extra
        assert args.sliding_window == ref.sliding_window, extra  # None: no window (full attention)
        assert args.window_layers is None, extra  # the window (if any) is on every layer


def test_expert_shape_matches_the_stacked_checkpoint_shape(tmp_path):
    from megarl.models import layouts as L
    from megarl.models.random_hf import tiny_config, write_random_hf
    from megarl.protocol.hf_model import param_table

    args = read_model_args(write_random_hf(str(tmp_path), tiny_config("Qwen3MoeForCausalLM")))
    stacked = L.mcore_shapes(args)
    for _, pmap in param_table(args):
        if pmap.expert is not None:
            assert L.expert_shape(pmap, args) == stacked[L.mcore_key(pmap)][2:]


def test_expert_names_of_both_expert_modules_map_to_global_rows():
    """SequentialMLP (local spec) and TEGroupedMLP (TE spec, grouped GEMM) name a rank's experts
    differently; both map to the table's global expert (EP rank 1 of 2 holds experts 2 and 3)."""
    from megarl.models.hf_io import expert_row_name

    local = [2, 3]
    assert expert_row_name("mlp.experts.local_experts.1.linear_fc1.weight", local) == \
        "mlp.experts.local_experts.3.linear_fc1.weight"
    assert expert_row_name("mlp.experts.linear_fc1.weight0", local) == "mlp.experts.local_experts.2.linear_fc1.weight"
    assert expert_row_name("mlp.experts.linear_fc2.weight1", local) == "mlp.experts.local_experts.3.linear_fc2.weight"
    assert expert_row_name("mlp.router.weight", local) == "mlp.router.weight"


def test_router_loss_coefficients_per_step():
    """coeff x loss tokens / routed tokens, so megatron-core's per-token scaling (divide by the
    loss tokens) leaves coeff x the token-weighted mean; a z-loss of 0 stays None (not computed)."""
    from types import SimpleNamespace

    from megarl.trainer.moe_losses import set_step_coefficients

    tc = SimpleNamespace()
    set_step_coefficients(tc, 0.01, 0.0, loss_tokens=30.0, routed_tokens=120.0)
    assert (tc.moe_aux_loss_coeff, tc.moe_z_loss_coeff) == (0.0025, None)
    set_step_coefficients(tc, 0.0, 0.002, loss_tokens=50.0, routed_tokens=100.0)
    assert (tc.moe_aux_loss_coeff, tc.moe_z_loss_coeff) == (0.0, 0.001)
