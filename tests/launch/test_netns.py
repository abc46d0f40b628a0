"""Two "nodes" that share no loopback: each is its own network namespace, joined by a veth pair
(10.77.0.1 and 10.77.0.2). launch/torchrun_multinode.sh runs the demo config at PP=2, one rank per
node. Rank 0 (node A) serves the rollout server at A's address; rank 1 (node B) is stage 1's weight
source and must advertise B's address: 127.0.0.1 in B is B's own loopback, so any rank that handed
out a loopback address would fail the push. With synchronous rollouts (max_staleness=0) every step
trains on samples generated from the weights just pushed, so the server's logprobs equal the
trainer's (<= 1e-5) only if both stages' distributed pushes landed."""
import os
import re
import shutil
import subprocess

import pytest

from launchkit import REPO, clean_env, demo_overrides, metric_rows

TORCHRUN_SH = os.path.join(REPO, "launch", "torchrun_multinode.sh")
TINY_BYTES = os.path.getsize(os.path.join(REPO, "examples", "tiny", "model", "model.safetensors"))


def ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture
def two_nodes():
    """Namespaces A and B, each with lo and an interface "mrl0" (same name on both nodes, so one
    GLOO_SOCKET_IFNAME fits both) on 10.77.0.0/24; removed afterwards."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("network namespaces need root and iproute2 (apt iproute2)")
    tag = f"mrl{os.getpid() % 100000}"
    a, b = f"{tag}a", f"{tag}b"
    made = []
    try:
        for ns in (a, b):
            r = ip("netns", "add", ns, check=False)
            if r.returncode:
                pytest.skip(f"cannot create a network namespace here: {r.stderr.strip()}")
            made.append(ns)
        r = ip("link", "add", f"{tag}x", "type", "veth", "peer", "name", f"{tag}y", check=False)
        if r.returncode:
            pytest.skip(f"cannot create a veth pair here: {r.stderr.strip()}")
        for ns, end, addr in ((a, f"{tag}x", "10.77.0.1/24"), (b, f"{tag}y", "10.77.0.2/24")):
            ip("link", "set", end, "netns", ns)
            ip("-n", ns, "link", "set", end, "name", "mrl0")
            ip("-n", ns, "addr", "add", addr, "dev", "mrl0")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", "mrl0", "up")
        yield a, b
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth pair, and so the pair
            ip("netns", "del", ns, check=False)


def test_pp2_across_two_namespaces_pushes_weights_and_matches_logprobs(two_nodes, tmp_path):
    a, b = two_nodes
    run = tmp_path / "run"
    args = demo_overrides(run, 3, "parallel.pp=2", "rollout.max_staleness=0")
    env = clean_env(GLOO_SOCKET_IFNAME="mrl0")
    procs = []
    for rank, ns in enumerate((a, b)):
        log = open(tmp_path / f"node{rank}.log", "w")
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, "bash", TORCHRUN_SH, "--nnodes", "2", "--node-rank", str(rank),
             "--nproc-per-node", "1", "--master-addr", "10.77.0.1", "--master-port", "29500", *args],
            env=env, cwd=str(tmp_path), stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [(tmp_path / f"node{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "[megarl] 2 rank(s) from torchrun, rendezvous 10.77.0.1:29500" in logs[0]
    # each run names its groups anew (megarl-weights-pp<stage>-<8 hex>): a dead run's cannot block it
    assert re.search(r"\[weights\] stage 0: weight-update group megarl-weights-pp0-[0-9a-f]{8} at 10\.77\.0\.1:", logs[0])
    assert re.search(r"\[weights\] stage 1: weight-update group megarl-weights-pp1-[0-9a-f]{8} at 10\.77\.0\.2:", logs[1])
    server = (run / "servers" / "server0.log").read_text()
    assert "megarl-server ready on http://10.77.0.1:" in server  # reachable from node B, not loopback
    rows = metric_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["push/bytes"] > 0.99 * TINY_BYTES - 4096 and r["staleness_max"] == 0
        assert r["logp_gap_max"] <= 1e-5, r  # server logprobs == trainer logprobs on pushed weights
