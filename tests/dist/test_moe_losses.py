"""The router's load-balancing loss and z-loss (moe.aux_loss_coeff, moe.z_loss_coeff) on a tiny
random Qwen3-MoE (4 experts, top-2, 4 layers), one training step over 3 micro-batches with padding
and prompt tokens: the reported ``moe_aux_loss`` / ``moe_z_loss`` equal a hand computation from
the router inputs megatron-core saw (Switch formula ``E * sum_e f_e * P_e`` over the micro-batch's
non-padding tokens; ``mean logsumexp(logits)^2``), averaged over micro-batches and layers; and the
last router's gradient moves by exactly coeff x d(token-weighted mean over micro-batches)/dW; with
expert parallelism (EP=2 over DP=2) the step gives the EP=1 loss, grad norm, post-step logprobs
and moe_aux_loss."""
import pytest
import torch

from distrun import torchrun

AUX, Z = 0.1, 0.01
SETTINGS = ["0,0", f"{AUX},0", f"0,{Z}"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from megarl.models.random_hf import tiny_config, write_random_hf

    d = tmp_path_factory.mktemp("moe_losses")
    hf = write_random_hf(str(d / "hf"), tiny_config("Qwen3MoeForCausalLM"), std=0.2)
    torchrun("moe_losses_worker.py", 1, hf, d / "out.pt", *SETTINGS)
    return torch.load(d / "out.pt", weights_only=False)


def router_terms(x, pad, weight, topk=2):
    """(Switch aux loss, z-loss, non-padding tokens) of one micro-batch at one layer, by hand."""
    x = x.reshape(-1, x.shape[-1])[~pad.reshape(-1)]
    logits = x.double() @ weight.double().T
    probs = torch.softmax(logits, dim=-1)
    tokens, experts = probs.shape
    chosen = torch.zeros_like(probs).scatter(1, probs.topk(topk, dim=1).indices, 1.0)
    f = chosen.sum(0) / (tokens * topk)  # share of the (token, slot) pairs sent to each expert
    p = probs.mean(0)  # mean router probability of each expert
    aux = experts * (f.detach() * p).sum()
    z = (torch.logsumexp(logits, dim=-1) ** 2).mean()
    return aux, z, tokens


def hand_metric(run, which):
    layers = []
    for i, mbs in run["inputs"].items():
        vals = [router_terms(x, pad, run["weights"][i])[which].item() for x, pad in mbs]
        layers.append(sum(vals) / len(vals))
    return sum(layers) / len(layers)


def test_reported_losses_equal_the_hand_computation(results):
    base, aux, z = (results[s] for s in SETTINGS)
    assert len(aux["inputs"][0]) == 3  # three micro-batches
    assert "moe_aux_loss" not in base["metrics"] and "moe_z_loss" not in base["metrics"]
    assert "moe_z_loss" not in aux["metrics"] and "moe_aux_loss" not in z["metrics"]
    want_aux, want_z = hand_metric(aux, 0), hand_metric(z, 1)
    assert aux["metrics"]["moe_aux_loss"] == pytest.approx(want_aux, rel=1e-5)
    assert z["metrics"]["moe_z_loss"] == pytest.approx(want_z, rel=1e-5)
    assert want_aux > 1.0 + 1e-3  # not the balanced optimum 1: the check sees the routing
    # the padding rows are left out: counting them changes the value
    x, pad = aux["inputs"][0][0]
    assert pad.any()
    assert router_terms(x, torch.zeros_like(pad), aux["weights"][0])[0].item() != pytest.approx(
        router_terms(x, pad, aux["weights"][0])[0].item(), rel=1e-4)
    # the router losses change the gradient, not the forward pass
    assert aux["metrics"]["loss"] == base["metrics"]["loss"] == z["metrics"]["loss"]


@pytest.mark.parametrize("which,coeff", [(0, AUX), (1, Z)])
def test_router_gradient_is_coeff_times_token_weighted_mean(results, which, coeff):
    base, run = results[SETTINGS[0]], results[SETTINGS[1 + which]]
    last = max(run["inputs"])
    assert torch.equal(run["weights"][last], base["weights"][last])
    weight = run["weights"][last].double().requires_grad_(True)
    terms = [router_terms(x, pad, weight) for x, pad in run["inputs"][last]]
    total = sum(n for _, _, n in terms)
    target = coeff * sum(t[which] * n for *t, n in terms) / total
    (want,) = torch.autograd.grad(target, weight)
    got = (run["last_router_grad"] - base["last_router_grad"]).double()
    assert want.abs().max() > 1e-4
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)


def test_aux_loss_under_expert_parallelism_matches_ep1(tmp_path):
    import json

    from megarl.models.random_hf import tiny_config, write_random_hf

    hf = write_random_hf(str(tmp_path / "hf"), tiny_config("Qwen3MoeForCausalLM"), std=0.2)
    ref, ep2 = "1,1,96,0,1,0.1", "1,1,96,0,2,0.1"  # DP=2, several micro-batches per rank
    torchrun("layouts_worker.py", 2, hf, tmp_path / "out.json", ref, ep2)
    results = json.loads((tmp_path / "out.json").read_text())
    a, b = results[ref], results[ep2]
    assert a["moe_aux_loss"] > 1.0 + 1e-3
    assert b["moe_aux_loss"] == pytest.approx(a["moe_aux_loss"], rel=1e-6)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    diff = max(abs(x - y) for r, s in zip(a["logp_after"], b["logp_after"]) for x, y in zip(r, s))
    assert diff <= 5e-5
