"""The rollout manager: a process of its own that owns everything on the rollout side.

    trainer rank 0 ──Link──┐                      rollout manager (this process)
    stage sources (PP>1) ──┤ channel (TCP)   ┌──────────────────────────────────────────────┐
                           └────────────────▶│ connection threads: one per trainer link     │
                                             │   BatchRequest -> controller.next_batch ->   │
                                             │     Batch (flat arrays, DP shares)           │
                                             │   ClusterCall  -> RolloutCluster (pause,     │
                                             │     publish, resume, commit, health, ...)    │
                                             │   AdminCall    -> AdminRunner (announce ...) │
                                             │   EvalSubmit/EvalPoll, StateRequest, Close   │
                                             │ controller thread: prompts -> staleness ->   │
                                             │   executor -> workflows -> rewards -> buffer │
                                             └──────────────────────┬───────────────────────┘
                                                                    │ HTTP (SGLang protocol)
                                                            inference servers (started here
                                                            when rollout.servers is empty)

Why a process: the controller's event loop (HTTP streams, rewards, workflows) used to be a thread
of trainer rank 0 and took the GIL from the training loop while generation overlapped the update
(docs/benchmarks.md). Here it runs beside the trainer, and trainer ranks only send requests and
read replies on a socket - no event loop, no thread of theirs serves rollout traffic.

Lifetime: started by trainer rank 0 (`spawn`) with the stop signals ignored and SIGKILL on the
death of its parent, so a Ctrl-C lets the trainer save (asking this process for its ledger) and a
dead trainer takes the manager and its servers with it. When the driver's connection closes the
manager stops. Its state (the prompt ledger) is saved inside the trainer's checkpoint.

    python -m megarl.rollout.manager RUN_DIR/config.yaml [--host H --port P]
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np

from megarl.rollout.channel import (DIRECT_REPLIES, AdminCall, Batch, BatchRequest, Channel, ChannelError,
                                    Close, ClusterCall, EvalPoll, EvalReport, EvalSubmit, Hello, Init,
                                    Reply, StateRequest, from_wire)

if TYPE_CHECKING:
    from megarl.config import RolloutConfig, WeightSyncConfig
    from megarl.rollout.setup import ControllerSpec, EvalSpec

log = logging.getLogger("megarl.manager")

# what a trainer link may run on the manager's RolloutCluster
CLUSTER_OPS = {"pause_for_update", "publish", "resume", "commit", "finish_push", "unhealthy",
               "remove_server", "add_server", "admitted", "start", "stats"}


def balance_groups(group_tokens: list[int], n_ranks: int) -> list[int]:
    """Rank of each group: longest first to the rank with the fewest tokens (LPT). Groups stay
    whole, so group-relative advantages never need another rank's samples."""
    loads = [0] * n_ranks
    rank = [0] * len(group_tokens)
    # ties broken by index (group, then rank): every run of the same batch gives the same placement
    for g in sorted(range(len(group_tokens)), key=lambda g: (-group_tokens[g], g)):
        r = min(range(n_ranks), key=lambda r: (loads[r], r))
        rank[g] = r
        loads[r] += group_tokens[g]
    return rank


def pack_batch(trajs, dp: int, stats: dict, rejoin: list[str]) -> Batch:
    """A step's trajectories as flat arrays plus each sample's DP rank (whole groups per rank)."""
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(trajs):
        groups.setdefault(t.group_id, []).append(i)
    gids = list(groups)
    ranks = balance_groups([sum(len(trajs[i].input_ids) for i in groups[g]) for g in gids], dp)
    dp_rank = np.zeros(len(trajs), dtype=np.int32)
    for g, r in zip(gids, ranks):
        dp_rank[groups[g]] = r
    cat = lambda name, dt: np.fromiter((x for t in trajs for x in getattr(t, name)), dtype=dt)  # noqa: E731
    arrays = {"input_ids": cat("input_ids", np.int64), "loss_mask": cat("loss_mask", np.int8),
              "behave_logp": cat("behave_logp", np.float64), "versions": cat("versions", np.int32),
              "lengths": np.array([len(t.input_ids) for t in trajs], dtype=np.int64),
              "rewards": np.array([t.reward for t in trajs], dtype=np.float64),
              "group_ids": np.array([t.group_id for t in trajs], dtype=np.int64), "dp_rank": dp_rank}
    if trajs and all(t.routes is not None for t in trajs):  # MoE routing replay: [tokens, layers, k]
        arrays["route_ids"] = np.concatenate([t.routes.ids for t in trajs]).astype(np.int32)
        arrays["route_weights"] = np.concatenate([t.routes.weights for t in trajs]).astype(np.float32)
    return Batch(infos=[t.info for t in trajs], stats=stats, rejoin=rejoin, arrays=arrays)


@dataclass(frozen=True)
class ManagerSpec:
    """What the rollout manager is built from: the rollout section (servers, local server
    processes, API key), the weights section (deadline, pause mode, the disk transport's
    directory), the served model, the run directory, whether it writes a timeline, the local
    servers' extra flags, and the specs of its controller and evaluator."""

    rollout: "RolloutConfig"
    weights: "WeightSyncConfig"
    model_path: str
    run_dir: str
    controller: "ControllerSpec"
    eval: "EvalSpec"
    server_flags: tuple[str, ...] = ()
    timeline: bool = False

    @classmethod
    def from_config(cls, cfg) -> "ManagerSpec":
        from megarl.rollout.setup import ControllerSpec, EvalSpec, route_flags

        return cls(cfg.rollout, cfg.weights, cfg.model.hf_path, cfg.train.run_dir, ControllerSpec.from_config(cfg),
                   EvalSpec.from_config(cfg), tuple(route_flags(cfg)), cfg.logging.timeline)


class RolloutManager:
    """The rollout side of one run: local servers (if any), the server set and its admin
    connection, the controller and the evaluator; driven by trainer links (`serve`)."""

    def __init__(self, spec: Optional[ManagerSpec]):
        self.spec = spec
        self.stack = contextlib.ExitStack()
        self.cluster = self.controller = self.evaluator = self.local = None
        self.dp = 1
        self.stopped = threading.Event()
        self._updates = threading.Condition()
        self._inflight = 0  # weight-update calls (any link) that publish must wait for
        self._servers: Optional[list[str]] = None
        self._servers_error: Optional[BaseException] = None

    def begin_servers(self) -> None:
        """Local servers start before the first request is read (the trainer builds its engine
        meanwhile). On the main thread: a server gets SIGKILL when the thread that forked it ends
        (PR_SET_PDEATHSIG), so it must be one that lives as long as the run."""
        try:
            self._servers = self.start_servers()
        except Exception as e:  # noqa: BLE001 - reported to the trainer at Init
            self._servers_error = e

    # ------------------------------------------------------------------ build
    def start_servers(self) -> list[str]:
        from megarl.net import serving_host
        from megarl.rollout.local import LocalCluster

        spec, r = self.spec, self.spec.rollout
        if r.servers:
            return list(r.servers)
        # the trainer pinned this process to rollout.server_cpus already (RolloutSide.start)
        # only CPUs this process may use: pinning a server to a CPU outside the allowed set would fail
        server_cpus = set(r.server_cpus) & os.sched_getaffinity(0) if r.server_cpus else None
        launcher = None
        if r.engine == "sglang":
            from megarl.rollout.sglang_local import SGLangLauncher
            # the route flags (--enable-return-routed-experts) are SGLang's too
            launcher = SGLangLauncher(spec.model_path, [*spec.server_flags, *r.server_args], threads=r.server_threads)
        self.local = LocalCluster(spec.model_path, r.local_servers, f"{spec.run_dir}/servers",
                                  extra=["--threads", r.server_threads, *spec.server_flags, *r.server_args],
                                  host=serving_host(),
                                  weights_roots=[spec.weights.disk_dir or f"{spec.run_dir}/weights"],
                                  cpus=server_cpus, launcher=launcher, ready_timeout_s=r.health_timeout_s)
        return self.stack.enter_context(self.local)

    def init(self, msg: Init) -> list[str]:
        from megarl.rollout.cluster import RolloutCluster
        from megarl.rollout.setup import build_controller
        from megarl.timeline import Timeline

        if self._servers is None and self._servers_error is None:
            self.begin_servers()
        if self._servers_error is not None:
            raise self._servers_error
        servers = self._servers
        self.dp = msg.dp
        self.cluster = RolloutCluster.from_sections(self.spec.rollout, self.spec.weights, servers, driver=True)
        # the trainer's version (a resumed run's is > 0): the staleness clock continues from it
        self.cluster.version = int(msg.version)
        if self.local is not None:
            self.cluster.restart = self.local.restart
        self.stack.callback(self.cluster.close)
        timeline = Timeline(f"{self.spec.run_dir}/timeline/manager.jsonl" if self.spec.timeline else None)
        self.stack.callback(timeline.close)
        self.controller = build_controller(self.spec.controller, self.cluster, timeline)
        # a resumed run: the pending prompts of the checkpoint are issued before any new draw
        if msg.state is not None:
            self.controller.load_state_dict(msg.state)
        return list(self.cluster.addresses)

    def start(self) -> None:
        """After the first push: the servers hold the trainer's weights; generation may begin."""
        from megarl.rollout.setup import build_eval

        # subscribed before the controller starts: no hold/version event can arrive unseen
        self.cluster.subscribe(self.controller)
        self.controller.start()
        self.stack.callback(self.controller.stop)
        self.evaluator = build_eval(self.spec.eval, self.controller.reward)

    # ------------------------------------------------------------------ requests
    def next_batch(self, msg: BatchRequest) -> Batch:
        trajs = self.controller.next_batch(msg.n_groups, timeout_s=msg.timeout_s)
        c = self.controller
        # stats at hand-off time: the step logs what the rollouts had done when its batch was ready
        stats = {**c.stats(), "rollout/busy_s": c.client.busy_seconds(),
                 "rollout/tokens": c.client.stats["tokens"],
                 "rollout/live_servers": len(self.cluster.addresses),
                 "rollout/dead_servers": len(self.cluster.dead)}
        if self.local is not None:
            stats["rollout/restarts"] = self.local.restarts
        return pack_batch(trajs, self.dp, stats, self.cluster.ready_to_rejoin())

    def admin(self, msg: AdminCall):
        args, kwargs = from_wire(msg.args), from_wire(msg.kwargs)
        # weight loads are counted so that finish_push publishes only after every bucket is in
        update = msg.method.startswith("update_weights_from")
        if update:
            with self._updates:
                self._inflight += 1
        try:
            return self.cluster.admin.call(lambda c: getattr(c, msg.method)(*args, **kwargs), msg.timeout_s)
        finally:
            if update:
                with self._updates:
                    self._inflight -= 1
                    self._updates.notify_all()

    def cluster_call(self, msg: ClusterCall):
        if msg.method not in CLUSTER_OPS:
            raise ValueError(f"unknown cluster operation {msg.method!r}")
        if msg.method == "start":
            return self.start()
        if msg.method == "stats":
            return {"pauses": self.cluster.counters["pauses"], "continues": self.cluster.counters["continues"]}
        if msg.method == "finish_push":
            return self.finish_push(*msg.args)
        return getattr(self.cluster, msg.method)(*msg.args)

    def finish_push(self, version: int) -> dict:
        """The tail of a push, off the trainer's critical path: wait until every announced bucket
        is loaded (stage sources announce on their own links), flip the servers' version, end the
        update, commit the version (the staleness window moves), resume generation. A load still
        running after weights.timeout_s is no version the servers hold: generation resumes on
        the old one and the error surfaces at the next push (which then checks the servers)."""
        t0 = time.perf_counter()
        loaded = False
        try:
            with self._updates:
                loaded = self._updates.wait_for(lambda: self._inflight == 0, timeout=self.cluster.timeout_s)
        finally:
            # a load still running is not a version the servers hold: resume without the flip
            self.cluster.end_push(version if loaded else None)
        if not loaded:
            raise TimeoutError(f"weight push stalled: {self._inflight} weight-update call(s) still running "
                               f"after {self.cluster.timeout_s:g} s (weights.timeout_s); version {version} "
                               f"not published, generation resumed on the previous one")
        return {"commit_s": time.perf_counter() - t0}

    def handle(self, msg):
        if isinstance(msg, Init):
            return self.init(msg)
        if isinstance(msg, BatchRequest):
            return self.next_batch(msg)
        if isinstance(msg, AdminCall):
            return self.admin(msg)
        if isinstance(msg, ClusterCall):
            return self.cluster_call(msg)
        if isinstance(msg, EvalSubmit):
            if self.evaluator is not None:
                self.evaluator.submit(self.controller, msg.step, msg.version)
            return None
        if isinstance(msg, EvalPoll):
            if self.evaluator is None:
                return EvalReport(metrics={}, running=0)
            out = self.evaluator.poll(wait=msg.wait, timeout_s=msg.timeout_s, diagnose=self.controller.diagnose)
            return EvalReport(metrics=out or {}, running=self.evaluator.running)
        if isinstance(msg, StateRequest):
            return self.controller.state_dict()
        if isinstance(msg, Close):
            self.stopped.set()
            return None
        raise ValueError(f"unexpected message {type(msg).__name__}")

    def serve(self, channel: Channel) -> None:
        """One trainer link: requests in, replies out, in order. The driver's link closing (the
        trainer ended or died) stops the manager."""
        try:
            hello = channel.recv()
        except ChannelError:
            return
        driver = isinstance(hello, Hello) and hello.role == "driver"
        try:
            while not self.stopped.is_set():
                msg = channel.recv()
                t0 = time.perf_counter()
                try:
                    value = self.handle(msg)
                    reply = value if isinstance(value, DIRECT_REPLIES) else Reply(value=value)
                except Exception as e:  # noqa: BLE001 - the trainer gets the error as one line
                    log.warning("%s failed: %s: %s", type(msg).__name__, type(e).__name__, e)
                    # first line only: the trainer re-raises it as one line (RemoteError), the traceback stays in this log
                    reply = Reply(error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                if isinstance(reply, Reply):
                    reply.elapsed_s = time.perf_counter() - t0
                channel.send(reply)
        except ChannelError:
            pass
        finally:
            channel.close()
            if driver:
                self.stopped.set()

    def close(self) -> None:
        self.stack.close()


def serve_forever(manager: RolloutManager, listener: socket.socket) -> None:
    # accept() wakes every 0.5 s to notice `stopped` (set when the driver's link closes)
    listener.settimeout(0.5)
    while not manager.stopped.is_set():
        try:
            sock, addr = listener.accept()
        except socket.timeout:
            continue
        # a link blocks in recv between requests: no timeout on the accepted socket itself
        sock.settimeout(None)
        threading.Thread(target=manager.serve, args=(Channel(sock, f"trainer link {addr}"),),
                         name="megarl-link", daemon=True).start()
    manager.close()


def start_process(config_path: str, host: str, log_path: str, cpus=None):
    """Start the manager process and return at once: it imports, listens and starts its servers
    while the caller goes on (`wait_listening` then reads its address)."""
    import subprocess

    from megarl.signals import owned_child_setup

    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    with open(log_path, "a") as log_file:  # the child holds its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", "megarl.rollout.manager", config_path, "--host", host,
                                 # port 0: the OS picks a free port and the manager prints it (no race over a chosen port)
                                 "--port", "0"], stdout=subprocess.PIPE, stderr=log_file,
                                preexec_fn=owned_child_setup, text=True)
    if cpus:
        os.sched_setaffinity(proc.pid, cpus)
    return proc


def wait_listening(proc, log_path: str) -> str:
    """The "host:port" the process from `start_process` listens on, once it does."""
    line = proc.stdout.readline().strip()  # "listening HOST:PORT", or EOF when it failed
    if not line.startswith("listening "):
        proc.wait(timeout=30)
        raise RuntimeError(f"rollout manager did not start (exit {proc.returncode}; log {log_path}): "
                           f"{_tail(log_path)}")
    return line.split(" ", 1)[1]


def _tail(path: str) -> str:
    try:
        lines = [x for x in open(path).read().splitlines() if x.strip()]
        return lines[-1] if lines else ""
    except OSError:
        return ""


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="megarl-rollout-manager", description=__doc__.splitlines()[0])
    ap.add_argument("config", help="the run's resolved config.yaml")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="[manager] %(levelname)s %(message)s")
    from megarl.config import load_config

    spec = ManagerSpec.from_config(load_config(args.config))
    # nothing heavy runs here: the cores are the trainer's and the servers'. The manager itself
    # never imports torch (~1.8 s before it could listen); a plugin that does gets one thread, and
    # so do the processes it starts that do not set their own (megarl-server sets --threads).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the controller's loop thread holds the GIL most of the time; a trainer request waiting in a
    # connection thread gets it within ~1 ms instead of the default 5 ms switch interval
    sys.setswitchinterval(0.001)
    listener = socket.create_server((args.host, args.port))
    host, port = listener.getsockname()[:2]
    print(f"listening {host}:{port}", flush=True)
    os.dup2(2, 1)  # the spawner reads that one line; everything else goes to the manager's log
    manager = RolloutManager(spec)
    manager.begin_servers()  # the trainer's connection waits in the listen backlog meanwhile
    try:
        serve_forever(manager, listener)
    finally:
        listener.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
