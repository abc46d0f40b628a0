"""Weight push from real megatron-core layouts to a real megarl CPU server over loopback:
after a push the server's logprobs equal the trainer's and its weights equal the HF export
bitwise, for every transport; a hung or dead server makes every rank fail within the timeout.
An odd-shaped model (vocab 333, which Megatron pads to 512 rows at TP=2; 3 layers split [2, 1]
over PP=2) reaches the server with its original 333-row tensors.

Every case is a job of JOBS: one torchrun launch per rank count runs all of its jobs in turn
(push_worker.py), each against its own fresh server(s), so the ranks' imports are paid twice, not
once per case."""
import json
import os
import socket
from dataclasses import dataclass

import pytest
from safetensors.torch import load_file

from distrun import torchrun
from megarl.models.random_hf import tiny_config, write_random_hf
from megarl.rollout.local import spawn_server, wait_ready
from megarl.common.net import free_port

SPECS = [f"{layout},{transport}" for transport in ("distributed", "disk", "tensor")
         for layout in ("1,1", "2,1", "1,2", "2,2")]  # TP=1, TP=2, PP=2, TP=2 x PP=2
SPECS += ["1,1,distributed,shard", "2,1,distributed,shard"]  # weights.refit=shard into a TP=1 server
MOE_SPECS = [f"1,1,{transport},gather,2" for transport in ("distributed", "disk", "tensor")]  # EP=2 (DP=2)
ODD_SPECS = ["2,2,distributed", "1,2,tensor"]
# trainer TP 1 and 2 into a megarl-server --tp 2 (the TP=1 server cells are SPECS above)
SERVER_TP_SPECS = ["1,1,distributed", "2,1,distributed", "2,1,tensor",
                   "1,1,distributed,shard", "2,1,distributed,shard"]  # 4th field: weights.refit


@dataclass(frozen=True)
class Job:
    """One case of a launch: a push_worker.py mode, its models and its own server(s)."""
    name: str
    mode: str
    model: str = "llama"  # a key of MODELS
    servers: int = 1
    server_args: tuple = ()
    specs: tuple = ()
    how: str = ""  # stall: "hang" | "dead"


MODELS = {"llama": {}, "moe": {"arch": "Qwen3MoeForCausalLM"}, "odd": {"vocab_size": 333, "num_hidden_layers": 3}}
JOBS = {  # rank count -> the jobs of its launch, in order; the stalls last (they leave groups behind)
    4: [Job("layouts", "layouts", specs=tuple(SPECS)), Job("odd", "layouts", "odd", specs=tuple(ODD_SPECS)),
        Job("join", "join", servers=2)],  # join: TP=2 x PP=2
    2: [Job("moe", "layouts", "moe", specs=tuple(MOE_SPECS)),
        Job("tp2_server", "layouts", server_args=("--tp", "2"), specs=tuple(SERVER_TP_SPECS)),
        Job("delta", "delta"), Job("disk_delta", "disk_delta"),
        Job("stall_hang", "stall", how="hang"), Job("stall_dead", "stall", how="dead")],
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(dir, {model: (weights A, weights B)}): random tiny HF checkpoints side by side under one
    directory (a server reads disk pushes under its model's parent, where the jobs' work dirs are)."""
    d = tmp_path_factory.mktemp("push")
    out = {name: tuple(write_random_hf(str(d / f"{name}_{w}"), tiny_config(**kw), seed=seed)
                       for w, seed in (("a", 1), ("b", 2)))
           for name, kw in MODELS.items()}
    return d, out


def start_servers(wanted: list[tuple]) -> list[tuple]:
    """[(url, proc)] of megarl-servers for [(model dir, log, extra args)], started at once and then
    waited for; one that loses its port to another process before binding it starts again on a new one."""
    ports = _distinct_free_ports(len(wanted))
    spawned = [spawn_server(m, log, port, extra) for (m, log, extra), port in zip(wanted, ports)]
    out = []
    try:
        for (m, log, extra), port, proc in zip(wanted, ports, list(spawned)):
            for attempt in range(3):
                try:
                    wait_ready(f"http://127.0.0.1:{port}", proc, log)
                    break
                except RuntimeError as e:
                    if attempt == 2 or "address already in use" not in str(e):
                        raise
                    port = free_port()
                    proc = spawn_server(m, log, port, extra)
                    spawned.append(proc)
            out.append((f"http://127.0.0.1:{port}", proc))
    except BaseException:
        for proc in spawned:
            proc.kill()
        raise
    return out


def _distinct_free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:  # all bound at once: n different ports
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture(scope="module")
def push_job(models):
    """push_job(nproc) -> {job name: (result, server urls)}: the first call for a rank count starts
    every server of its jobs (weights A) at once, runs the one launch and kills the servers; later
    calls return the same results (or the same failure, without launching again)."""
    d, paths = models
    done = {}

    def run(nproc: int) -> dict:
        if nproc not in done:
            done[nproc] = f"the {nproc}-rank launch failed in an earlier test"  # no second launch
            wanted = [(paths[job.model][0], str(d / f"{job.name}_server{i}.log"), job.server_args)
                      for job in JOBS[nproc] for i in range(job.servers)]
            servers = start_servers(wanted)
            try:
                plan, k = [], 0
                for job in JOBS[nproc]:
                    mine, k = servers[k:k + job.servers], k + job.servers
                    plan.append({"name": job.name, "mode": job.mode, "hf_a": paths[job.model][0],
                                 "hf_b": paths[job.model][1], "servers": [u for u, _ in mine],
                                 "pids": [p.pid for _, p in mine], "work": str(d / job.name),
                                 "specs": list(job.specs), "how": job.how})
                (d / f"plan{nproc}.json").write_text(json.dumps(plan))
                torchrun("push_worker.py", nproc, d / f"plan{nproc}.json", d / f"results{nproc}.json")
                results = json.loads((d / f"results{nproc}.json").read_text())
                done[nproc] = {job["name"]: (results[job["name"]], job["servers"]) for job in plan}
            finally:
                for _, proc in servers:
                    proc.kill()
        if isinstance(done[nproc], str):
            pytest.fail(done[nproc])
        return done[nproc]

    return run


@pytest.mark.parametrize("spec", SPECS)
def test_push_makes_server_equal_trainer(push_job, spec):
    r = push_job(4)["layouts"][0][spec]
    assert r["before"] > 0.1  # the server really had other weights
    assert r["after"] <= 1e-5
    assert r["bad"] == []  # every HF tensor on the server equals the export, bitwise
    assert r["version"] == "1"
    assert r["bytes"] == 657664  # fp32 tiny Llama: 164,416 params


@pytest.mark.parametrize("spec", MOE_SPECS)
def test_moe_experts_reach_the_server_by_every_transport(push_job, models, spec):
    """Qwen3-MoE with its experts split over 2 expert-parallel ranks: every transport gathers them
    and the served MoE model then equals the trainer."""
    r = push_job(2)["moe"][0][spec]
    hf_bytes = sum(t.numel() * t.element_size()
                   for t in load_file(os.path.join(models[1]["moe"][1], "model.safetensors")).values())
    assert r["before"] > 0.1 and r["after"] <= 1e-5
    assert r["bad"] == []  # every expert tensor (and the routers) equal the HF file bitwise
    assert r["version"] == "1"
    assert r["bytes"] == hf_bytes  # each expert sent once, though each rank holds half of them


@pytest.mark.parametrize("spec", ODD_SPECS)
def test_padded_vocab_and_uneven_stages_reach_the_server_unpadded(push_job, spec):
    r = push_job(4)["odd"][0][spec]
    assert r["before"] > 0.1 and r["after"] <= 1e-5
    assert r["bad"] == []  # 333-row embedding / lm_head equal the HF file bitwise
    # fp32 bytes of the original model: 2 x 333 x 64 (embed, head) + 3 x 36,992 + 64 parameters
    assert r["bytes"] == 4 * (2 * 333 * 64 + 3 * 36992 + 64)


@pytest.mark.parametrize("how", ["hang", "dead"])
def test_stalled_or_dead_server_fails_within_timeout(push_job, how):
    ranks, (url,) = push_job(2)[f"stall_{how}"]
    assert len(ranks) == 2
    for r in ranks:
        # the push fails the server within its deadline, the cluster drops it (health check)
        # and, with no server left, every rank stops with the same error naming it
        assert r["error"] is not None and r["error"].startswith("ClusterError")
        assert "rollout.min_live_servers" in r["error"] and url in r["error"]
        # pause deadline (4 s) + health check (<= 3 s) + group teardown (<= 4 s): never a hang
        assert r["elapsed"] < 3 * 4 + 3


def test_late_server_gets_current_weights_and_verify(push_job):
    r, (_, url2) = push_job(4)["join"]  # TP=2 x PP=2
    assert r["late_before"] > 0.1 and r["late_after"] <= 1e-5 and r["first_after"] <= 1e-5
    assert r["late_version"] == r["first_version"] == "1" and r["pusher_version"] == 1
    assert r["verify_ok"] == []
    # every tensor of the tampered server is reported (names carry the server address)
    assert len(r["verify_tampered"]) == 39 and all(x.startswith(url2) for x in r["verify_tampered"])


def test_delta_push_sends_only_changed_tensors(push_job):
    """weights.delta (default on) with optim.freeze = embedding + layer 0 of the tiny Llama: the
    optimizer leaves those bitwise unchanged through 4 real steps, the first push sends them and
    the next two do not; afterwards the server equals the trainer bitwise on all 39 tensors."""
    r = push_job(2)["delta"][0]
    # frozen: embedding 128*64 + layer 0 (q 64*64, k, v 32*64 each, o 64*64, gate/up/down 128*64
    # each, two norms of 64) = 8,192 + 36,992 params = 180,736 bytes; fp32 model: 164,416 params
    assert r["sent"] == [657664, 657664 - 4 * (128 * 64 + 36992), 476928] and r["sent"][1] == 476928
    # rank 0's frozen Megatron params: embedding, fused qkv, proj, fc1, fc2 and their 2 norm weights
    assert r["frozen_params"] == 7 and r["frozen_changed"] == [] and r["trainable_unchanged"] == []
    assert r["after"] <= 1e-5 and r["version"] == "3"
    assert r["compared"] == 39 and r["differ"] == [] and r["verify"] == []


@pytest.mark.parametrize("spec", SERVER_TP_SPECS)
def test_push_into_tp2_server_makes_it_equal_trainer(push_job, spec):
    r = push_job(2)["tp2_server"][0][spec]
    assert r["before"] > 0.1 and r["after"] <= 1e-5 and r["version"] == "1"
    assert r["bad"] == []  # every tensor, gathered from both server ranks, equals the export bitwise
    assert r["verify"] == []  # and its checksum equals the trainer's
    # shard refit sends the replicated tensors (embedding, lm_head, 9 norms of 64) to both server
    # ranks: 657,664 + 4 x (2 x 128 x 64 + 9 x 64) = 725,504 bytes; the gathered push sends each once
    assert r["bytes"] == (725504 if spec.endswith("shard") else 657664)


def test_disk_delta_push_is_bitwise(push_job):
    """weights.transport=disk with weights.disk_delta=raw and optim.freeze = embedding + layer 0:
    the first push writes raw records; the second writes nothing for the 10 frozen tensors and the
    trainable ones raw; the third (as with weights.disk_delta=xor) XOR+zlib records against the
    second; a delta the server refuses (it moved to another version) is followed by an all-raw
    push. The server rebuilds every tensor, checks its CRC-32 and then equals the trainer bitwise."""
    r = push_job(2)["disk_delta"][0]
    # raw: 164,416 fp32 params; then the trainable 476,928 bytes (as in the distributed delta test)
    assert r["sent"][:2] == [657664, 476928] and r["sent"][2] < 476928
    assert r["codecs"] == ["same"] * 10 + ["xor"] * 29 and r["frozen_record_bytes"] == 0
    assert r["base"] == "2"
    # a server moved to another version refuses the next delta; the push after it is all raw
    assert "delta against version 3, the server holds elsewhere" in r["refused"]
    assert r["sent"][3] == 657664 and r["retry_base"] is None and r["retry_codecs"] == ["raw"]
    assert r["version"] == "4"
    assert r["after"] <= 1e-5 and r["compared"] == 39 and r["differ"] == []
