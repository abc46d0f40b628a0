"""Weight push from real megatron-core layouts to a real megarl CPU server over loopback:
after a push the server's logprobs equal the trainer's and its weights equal the HF export
bitwise, for every transport; a hung or dead server makes every rank fail within the timeout.
An odd-shaped model (vocab 333, which Megatron pads to 512 rows at TP=2; 3 layers split [2, 1]
over PP=2) reaches the server with its original 333-row tensors."""
import json
import os

import pytest
from safetensors.torch import load_file

from distrun import start_server, torchrun
from megarl.models.random_hf import tiny_config, write_random_hf

SPECS = [f"{layout},{transport}" for transport in ("distributed", "disk", "tensor")
         for layout in ("1,1", "2,1", "1,2", "2,2")]  # TP=1, TP=2, PP=2, TP=2 x PP=2
SPECS += ["1,1,distributed,shard", "2,1,distributed,shard"]  # weights.refit=shard into a TP=1 server


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("push")
    a = write_random_hf(str(d / "a"), tiny_config(), seed=1)
    b = write_random_hf(str(d / "b"), tiny_config(), seed=2)
    return d, a, b


@pytest.fixture(scope="module")
def layouts(models):
    d, a, b = models
    url, proc = start_server(a, str(d / "server.log"))
    try:
        out = d / "layouts.json"
        torchrun("push_worker.py", 4, "layouts", a, b, url, d, out, *SPECS)
        return json.loads(out.read_text())
    finally:
        proc.kill()


@pytest.mark.parametrize("spec", SPECS)
def test_push_makes_server_equal_trainer(layouts, spec):
    r = layouts[spec]
    assert r["before"] > 0.1  # the server really had other weights
    assert r["after"] <= 1e-5
    assert r["bad"] == []  # every HF tensor on the server equals the export, bitwise
    assert r["version"] == "1"
    assert r["bytes"] == 657664  # fp32 tiny Llama: 164,416 params


MOE_SPECS = [f"1,1,{transport},gather,2" for transport in ("distributed", "disk", "tensor")]  # EP=2 (DP=2)


@pytest.fixture(scope="module")
def moe_layouts(tmp_path_factory):
    d = tmp_path_factory.mktemp("push_moe")
    cfg = tiny_config("Qwen3MoeForCausalLM")
    a = write_random_hf(str(d / "a"), cfg, seed=1)
    b = write_random_hf(str(d / "b"), cfg, seed=2)
    url, proc = start_server(a, str(d / "server.log"))
    try:
        out = d / "layouts.json"
        torchrun("push_worker.py", 2, "layouts", a, b, url, d, out, *MOE_SPECS)
        hf_bytes = sum(t.numel() * t.element_size()
                       for t in load_file(os.path.join(b, "model.safetensors")).values())
        return json.loads(out.read_text()), hf_bytes
    finally:
        proc.kill()


@pytest.mark.parametrize("spec", MOE_SPECS)
def test_moe_experts_reach_the_server_by_every_transport(moe_layouts, spec):
    """Qwen3-MoE with its experts split over 2 expert-parallel ranks: every transport gathers them
    and the served MoE model then equals the trainer."""
    results, hf_bytes = moe_layouts
    r = results[spec]
    assert r["before"] > 0.1 and r["after"] <= 1e-5
    assert r["bad"] == []  # every expert tensor (and the routers) equal the HF file bitwise
    assert r["version"] == "1"
    assert r["bytes"] == hf_bytes  # each expert sent once, though each rank holds half of them


ODD_SPECS = ["2,2,distributed", "1,2,tensor"]


@pytest.fixture(scope="module")
def odd_layouts(tmp_path_factory):
    d = tmp_path_factory.mktemp("push_odd")
    cfg = tiny_config(vocab_size=333, num_hidden_layers=3)
    a = write_random_hf(str(d / "a"), cfg, seed=1)
    b = write_random_hf(str(d / "b"), cfg, seed=2)
    url, proc = start_server(a, str(d / "server.log"))
    try:
        out = d / "layouts.json"
        torchrun("push_worker.py", 4, "layouts", a, b, url, d, out, *ODD_SPECS)
        return json.loads(out.read_text())
    finally:
        proc.kill()


@pytest.mark.parametrize("spec", ODD_SPECS)
def test_padded_vocab_and_uneven_stages_reach_the_server_unpadded(odd_layouts, spec):
    r = odd_layouts[spec]
    assert r["before"] > 0.1 and r["after"] <= 1e-5
    assert r["bad"] == []  # 333-row embedding / lm_head equal the HF file bitwise
    # fp32 bytes of the original model: 2 x 333 x 64 (embed, head) + 3 x 36,992 + 64 parameters
    assert r["bytes"] == 4 * (2 * 333 * 64 + 3 * 36992 + 64)


@pytest.mark.parametrize("how", ["hang", "dead"])
def test_stalled_or_dead_server_fails_within_timeout(models, how):
    d, a, b = models
    url, proc = start_server(a, str(d / f"server_{how}.log"))
    try:
        out = d / f"{how}.json"
        torchrun("push_worker.py", 2, "stall", a, b, url, d, out, proc.pid, how, timeout=180)
        ranks = json.loads(out.read_text())
    finally:
        proc.kill()
    assert len(ranks) == 2
    for r in ranks:
        # the push fails the server within its deadline, the cluster drops it (health check)
        # and, with no server left, every rank stops with the same error naming it
        assert r["error"] is not None and r["error"].startswith("ClusterError")
        assert "rollout.min_live_servers" in r["error"] and url in r["error"]
        # pause deadline (4 s) + health check (<= 3 s) + group teardown (<= 4 s): never a hang
        assert r["elapsed"] < 3 * 4 + 3


def test_late_server_gets_current_weights_and_verify(models):
    d, a, b = models
    url1, p1 = start_server(a, str(d / "server_j1.log"))
    url2, p2 = start_server(a, str(d / "server_j2.log"))
    try:
        out = d / "join.json"
        torchrun("push_worker.py", 4, "join", a, b, url1, d, out, url2)  # TP=2 x PP=2
        r = json.loads(out.read_text())
    finally:
        p1.kill()
        p2.kill()
    assert r["late_before"] > 0.1 and r["late_after"] <= 1e-5 and r["first_after"] <= 1e-5
    assert r["late_version"] == r["first_version"] == "1" and r["pusher_version"] == 1
    assert r["verify_ok"] == []
    # every tensor of the tampered server is reported (names carry the server address)
    assert len(r["verify_tampered"]) == 39 and all(x.startswith(url2) for x in r["verify_tampered"])


def test_delta_push_sends_only_changed_tensors(models):
    """weights.delta (default on) with optim.freeze = embedding + layer 0 of the tiny Llama: the
    optimizer leaves those bitwise unchanged through 4 real steps, the first push sends them and
    the next two do not; afterwards the server equals the trainer bitwise on all 39 tensors."""
    d, a, b = models
    url, proc = start_server(a, str(d / "server_delta.log"))
    try:
        out = d / "delta.json"
        torchrun("push_worker.py", 2, "delta", a, b, url, d, out)
        r = json.loads(out.read_text())
    finally:
        proc.kill()
    # frozen: embedding 128*64 + layer 0 (q 64*64, k, v 32*64 each, o 64*64, gate/up/down 128*64
    # each, two norms of 64) = 8,192 + 36,992 params = 180,736 bytes; fp32 model: 164,416 params
    assert r["sent"] == [657664, 657664 - 4 * (128 * 64 + 36992), 476928] and r["sent"][1] == 476928
    # rank 0's frozen Megatron params: embedding, fused qkv, proj, fc1, fc2 and their 2 norm weights
    assert r["frozen_params"] == 7 and r["frozen_changed"] == [] and r["trainable_unchanged"] == []
    assert r["after"] <= 1e-5 and r["version"] == "3"
    assert r["compared"] == 39 and r["differ"] == [] and r["verify"] == []


# trainer TP 1 and 2 into a megarl-server --tp 2 (the TP=1 server cells are SPECS above)
SERVER_TP_SPECS = ["1,1,distributed", "2,1,distributed", "2,1,tensor",
                   "1,1,distributed,shard", "2,1,distributed,shard"]  # 4th field: weights.refit


@pytest.fixture(scope="module")
def tp2_server_layouts(models):
    d, a, b = models
    url, proc = start_server(a, str(d / "server_tp2.log"), ["--tp", "2"])
    try:
        out = d / "layouts_tp2.json"
        torchrun("push_worker.py", 2, "layouts", a, b, url, d, out, *SERVER_TP_SPECS)
        return json.loads(out.read_text())
    finally:
        proc.kill()


@pytest.mark.parametrize("spec", SERVER_TP_SPECS)
def test_push_into_tp2_server_makes_it_equal_trainer(tp2_server_layouts, spec):
    r = tp2_server_layouts[spec]
    assert r["before"] > 0.1 and r["after"] <= 1e-5 and r["version"] == "1"
    assert r["bad"] == []  # every tensor, gathered from both server ranks, equals the export bitwise
    assert r["verify"] == []  # and its checksum equals the trainer's
    # shard refit sends the replicated tensors (embedding, lm_head, 9 norms of 64) to both server
    # ranks: 657,664 + 4 x (2 x 128 x 64 + 9 x 64) = 725,504 bytes; the gathered push sends each once
    assert r["bytes"] == (725504 if spec.endswith("shard") else 657664)


def test_disk_delta_push_is_bitwise(models):
    """weights.transport=disk with weights.disk_delta=raw and optim.freeze = embedding + layer 0:
    the first push writes raw records; the second writes nothing for the 10 frozen tensors and the
    trainable ones raw; the third (as with weights.disk_delta=xor) XOR+zlib records against the
    second; a delta the server refuses (it moved to another version) is followed by an all-raw
    push. The server rebuilds every tensor, checks its CRC-32 and then equals the trainer bitwise."""
    d, a, b = models
    url, proc = start_server(a, str(d / "server_disk_delta.log"))
    try:
        out = d / "disk_delta.json"
        torchrun("push_worker.py", 2, "disk_delta", a, b, url, d, out)
        r = json.loads(out.read_text())
    finally:
        proc.kill()
    # raw: 164,416 fp32 params; then the trainable 476,928 bytes (as in the distributed delta test)
    assert r["sent"][:2] == [657664, 476928] and r["sent"][2] < 476928
    assert r["codecs"] == ["same"] * 10 + ["xor"] * 29 and r["frozen_record_bytes"] == 0
    assert r["base"] == "2"
    # a server moved to another version refuses the next delta; the push after it is all raw
    assert "delta against version 3, the server holds elsewhere" in r["refused"]
    assert r["sent"][3] == 657664 and r["retry_base"] is None and r["retry_codecs"] == ["raw"]
    assert r["version"] == "4"
    assert r["after"] <= 1e-5 and r["compared"] == 39 and r["differ"] == []
