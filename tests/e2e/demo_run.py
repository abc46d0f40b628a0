"""The short GRPO demo run that several e2e tests only read (one `shared_train` run per session).

4 steps of configs/tiny_grpo.yaml (batch 64, async with the strict staleness rule, a held-out
evaluation every 2 steps, checksums of every push, TensorBoard and W&B offline, the HF export),
and while it runs `record_listeners` polls /proc for every listening TCP socket of its process
tree (trainer, rollout manager, megarl-server) and the ports the servers connect to.
Readers: test_train_grpo.py (the loop's metrics, sinks, export), test_listeners.py (the binds).

No harness import here: tests/dist/spawn_worker.py imports `listening` and `socket_inodes`
(through test_listeners) in a process that has only tests/e2e on its path."""
from __future__ import annotations

import ipaddress
import os
import subprocess
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EVAL = f"{REPO}/examples/tiny/data/eval_prompts.jsonl"

GRPO_STEPS = ("train.steps=4", "rollout.eval_interval=2", "rollout.eval_size=50", "rollout.max_staleness=1",
              "rollout.staleness_hard_cap=0",  # the strict rule: every trained token within 1
              "weights.verify_interval=1",  # checksums of every push (auto: every 10th)
              "train.global_batch_size=64", "rollout.eval_at_start=false")
SINKS = ("logging.tensorboard=true", "logging.wandb_project=megarl-test")
SINK_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def _addr(hex_addr: str) -> str:
    """/proc/net/tcp's little-endian hex address -> text."""
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


def _role(p, trainer_pid: int) -> str:
    if p.pid == trainer_pid:
        return "trainer"
    cmd = " ".join(p.cmdline())
    return "manager" if "megarl.rollout.manager" in cmd else "server" if "megarl.server" in cmd else cmd[:80]


def record_listeners(proc: subprocess.Popen) -> dict:
    """harness.train(during=...): every 0.1 s until the run ends, the listening sockets of the
    trainer's process tree. -> {"seen": {(role, address, port)}, "server_peers": {port}} (the
    ports the servers connected to as clients)."""
    import psutil

    seen: set[tuple[str, str, int]] = set()
    server_peers: set[int] = set()
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
                        seen.add((role, host, port))
                if role == "server":
                    server_peers |= {c.raddr.port for c in p.net_connections("tcp") if c.raddr}
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.1)
    return {"seen": seen, "server_peers": server_peers}


def demo_run(shared_train):
    """The session's one run of this configuration (made by whichever reader comes first)."""
    return shared_train(*GRPO_STEPS, "checkpoint.hf_export_dir=model", *SINKS, eval_data=EVAL, env=SINK_ENV,
                        during=record_listeners)
