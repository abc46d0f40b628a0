"""Every listening socket of a demo run binds the host it was told (loopback), read from
/proc/net/tcp{,6} while a real 3-step run goes on (trainer, rollout manager, megarl-server).

The weight-update group's rendezvous store on trainer rank 0 is among them (the servers join it
as clients: SGLang's `/init_weights_update_group` makes them meet through a TCP store). torch's
TCPStore would bind every interface whatever address it is given; megarl serves it on a socket
it bound itself (docs/reliability.md, Security), so any wildcard bind fails the test."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _addr(hex_addr: str) -> str:
    """/proc/net/tcp's little-endian hex address -> text."""
    import ipaddress

    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    v6 = ipaddress.IPv6Address(words)
    return str(v6.ipv4_mapped) if v6.ipv4_mapped else str(v6)


def listening() -> dict[int, tuple[str, int]]:
    """{socket inode: (address, port)} of every listening TCP socket on this host."""
    out = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(path).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A":  # TCP_LISTEN
                host, port = f[1].split(":")
                out[int(f[9])] = (_addr(host), int(port, 16))
    return out


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def _role(p: psutil.Process, trainer_pid: int) -> str:
    if p.pid == trainer_pid:
        return "trainer"
    cmd = " ".join(p.cmdline())
    return "manager" if "megarl.rollout.manager" in cmd else "server" if "megarl.server" in cmd else cmd[:80]


def test_no_wildcard_listener_during_a_demo_run(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megarl.train", os.path.join(REPO, "configs", "tiny_grpo.yaml"),
           f"model.hf_path={REPO}/examples/tiny/model", f"data.train_path={REPO}/examples/tiny/data/rl_prompts.jsonl",
           "data.eval_path=", f"train.run_dir={run}", "checkpoint.hf_export_dir=", "train.steps=3",
           "train.global_batch_size=16", "rollout.eval_at_start=false", "checkpoint.save_interval=0"]
    proc = subprocess.Popen(cmd, cwd=str(tmp_path), env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "err", "w"), start_new_session=True)
    seen: dict[tuple[str, str, int], str] = {}  # (role, address, port) -> role
    server_peers: set[int] = set()  # ports the servers connected to (as clients)
    trainer = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            tree = [trainer, *trainer.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        table = listening()
        for p in tree:
            try:
                role = _role(p, proc.pid)
                for inode in socket_inodes(p.pid):
                    if inode in table:
                        host, port = table[inode]
                        seen[(role, host, port)] = role
                if role == "server":
                    server_peers |= {c.raddr.port for c in p.net_connections("tcp") if c.raddr}
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.1)
    assert proc.wait(timeout=600) == 0, (tmp_path / "err").read_text()[-3000:]
    roles = {role for role, _, _ in seen}
    assert {"manager", "server"} <= roles, seen  # the run's listeners were seen at all
    assert all(host == "127.0.0.1" for _, host, _ in seen), sorted(seen)
    # the weight-update store was among them: a trainer listener the servers connected to
    store = [port for role, _, port in seen if role == "trainer" and port in server_peers]
    assert store, (sorted(seen), sorted(server_peers))
