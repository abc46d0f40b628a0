"""The rollout manager: a process of its own that owns everything on the rollout side.

    trainer rank 0 ──Link──┐                      rollout manager (this process)
    stage sources (PP>1) ──┤ channel (TCP)   ┌──────────────────────────────────────────────┐
                           └────────────────▶│ connection threads: one per trainer link     │
                                             │   BatchRequest -> controller.next_batch ->   │
                                             │     Batch (flat arrays, DP shares)           │
                                             │   PauseForUpdate, FinishPush, ... -> Cluster │
                                             │     publish, resume, commit, health, ...)    │
                                             │   admin messages -> AdminRunner (announce...)│
                                             │   EvalSubmit/EvalPoll, StateRequest, Close   │
                                             │ controller thread: prompts -> staleness ->   │
                                             │   executor -> workflows -> rewards -> buffer │
                                             └──────────────────────┬───────────────────────┘
                                                                    │ HTTP (SGLang protocol)
                                                            inference servers (started here
                                                            when rollout.servers is empty;
                                                            reward.model's reward servers too)

Why a process: the controller's event loop (HTTP streams, rewards, workflows) used to be a thread
of trainer rank 0 and took the GIL from the training loop while generation overlapped the update
(docs/benchmarks.md). Here it runs beside the trainer, and trainer ranks only send requests and
read replies on a socket - no event loop, no thread of theirs serves rollout traffic.

Lifetime: started by trainer rank 0 (`megarl.trainer.manager_process.start_process`) with the stop signals ignored and SIGKILL on the
death of its parent, so a Ctrl-C lets the trainer save (asking this process for its ledger) and a
dead trainer takes the manager and its servers with it. When the driver's connection closes the
manager stops. Its state (the prompt ledger) is saved inside the trainer's checkpoint.

Who may talk to it (docs/reliability.md, "Security"): a connection is served only after its peer
proved the run's secret (`megarl.protocol.handshake`) - from the spawning trainer through an inherited pipe
(``--secret-fd``), or from ``rollout.manager_secret_file`` when started apart; the roles a link
may have and what each may send: `megarl.rollout.links`.

    python -m megarl.rollout.manager RUN_DIR/config.yaml [--host H --port P] [--secret-fd N]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from megarl.common.errors import ConfigError
from megarl.protocol import handshake
from megarl.protocol.channel import from_wire
from megarl.protocol.messages import (ADMIN_MESSAGES, CLUSTER_MESSAGES, AddServer, Admitted, Batch, BatchRequest, Close,
                                      EvalPoll, EvalReport, EvalSubmit, FinishPush, Init, PauseForUpdate, PushFailed,
                                      RemoveServer, Resume, Sleep, Start, StateRequest, Unhealthy, UpdateFromDisk,
                                      UpdateFromDistributed, UpdateFromTensor, Wake)
from megarl.protocol.packing import balance_groups, pack_batch  # noqa: F401 - the step's layout
from megarl.protocol.wire_plan import WirePlan
from megarl.rollout.links import LinkServer, serve_forever

if TYPE_CHECKING:
    from megarl.config import EnvConfig, RewardModelConfig, RolloutConfig, TeacherConfig, WeightSyncConfig
    from megarl.rollout.setup import ControllerSpec, EvalSpec

log = logging.getLogger("megarl.manager")

# each step of the server set is one fixed call on the manager (m: the message, g: the manager)
CLUSTER_CALLS = {
    PauseForUpdate: lambda m, g: g.cluster.pause_for_update(),
    Resume: lambda m, g: g.cluster.end_push(None),  # a failed push: its session closed, generation resumed
    FinishPush: lambda m, g: g.finish_push(int(m.version)),
    Unhealthy: lambda m, g: g.cluster.unhealthy(),
    RemoveServer: lambda m, g: g.cluster.remove_server(str(m.address)),
    AddServer: lambda m, g: g.cluster.add_server(str(m.address)),
    Admitted: lambda m, g: g.cluster.admitted(str(m.address)),
    Start: lambda m, g: g.start(),
    Sleep: lambda m, g: g.cluster.sleep([str(t) for t in m.tags]),
    Wake: lambda m, g: g.cluster.wake([str(t) for t in m.tags]),
    PushFailed: lambda m, g: g.controller.fail(f"weight push failed: {m.error}"),
}
assert set(CLUSTER_CALLS) == set(CLUSTER_MESSAGES)
# weight loads: finish_push publishes only after every one of them is in
_LOADS = (UpdateFromDistributed, UpdateFromTensor, UpdateFromDisk)


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
    server_flags: tuple[str, ...] = ()  # what the run's features need of its servers (feature_flags)
    timeline: bool = False
    reward_model: Optional["RewardModelConfig"] = None  # reward.model when its path is set
    teacher: Optional["TeacherConfig"] = None  # teacher when its path is set (on-policy distillation)
    env: Optional["EnvConfig"] = None  # env when env.cls is set: the job serves the environment
    # the run's weight wire (<run_dir>/wire.json, saved by megarl-train); None: the weights section's
    wire: Optional[WirePlan] = None

    @classmethod
    def from_config(cls, cfg) -> "ManagerSpec":
        from megarl.config.server_flags import feature_flags
        from megarl.rollout.setup import ControllerSpec, EvalSpec
        from megarl.rollout.sglang_local import cuda_available

        # the manager is this process's child, on this node: its servers see the devices it sees
        flags = feature_flags(cfg, cfg.rollout.engine, gpu=cfg.rollout.engine == "sglang" and cuda_available())
        wire = WirePlan.for_run(cfg)
        return cls(cfg.rollout, cfg.weights, cfg.model.hf_path, cfg.train.run_dir, ControllerSpec.from_config(cfg, wire.peft),
                   EvalSpec.from_config(cfg), tuple(flags), cfg.logging.timeline,
                   cfg.reward.model if cfg.reward.model.path else None, cfg.teacher if cfg.teacher.path else None,
                   cfg.env if cfg.env.cls else None, wire)


class RolloutManager(LinkServer):
    """The rollout side of one run: local servers (if any), the server set and its admin
    connection, the controller and the evaluator; driven by trainer links (`LinkServer.serve`)."""

    def __init__(self, spec: Optional[ManagerSpec]):
        super().__init__()
        self.spec = spec
        self.stack = contextlib.ExitStack()
        self.cluster = self.controller = self.evaluator = self.local = self.reward_servers = None
        self.teacher_servers = self.env_servers = None
        self.dp = 1
        self._updates = threading.Condition()
        self._inflight = 0  # weight-update calls (any link) that publish must wait for
        self._servers: Optional[list[str]] = None
        self._servers_error: Optional[BaseException] = None
        self._servers_begun = False
        self._servers_done = threading.Event()

    def begin_servers(self) -> None:
        """Local servers start before the first request is read (the trainer builds its engine
        meanwhile). On the main thread: a server gets SIGKILL when the thread that forked it ends
        (PR_SET_PDEATHSIG), so it must be one that lives as long as the run."""
        self._servers_begun = True
        try:
            self._servers = self.start_servers()
        except Exception as e:  # noqa: BLE001 - reported to the trainer at Init
            self._servers_error = e
        finally:
            self._servers_done.set()

    # ------------------------------------------------------------------ build
    def start_servers(self) -> list[str]:
        from megarl.common.net import serving_host
        from megarl.rollout.local import LocalServers

        spec, r = self.spec, self.spec.rollout
        # the trainer pinned this process to rollout.server_cpus already (RolloutSide.start)
        # only CPUs this process may use: pinning a server to a CPU outside the allowed set would fail
        server_cpus = set(r.server_cpus) & os.sched_getaffinity(0) if r.server_cpus else None
        if spec.reward_model is not None:
            self.start_reward_servers(server_cpus)
        if spec.teacher is not None:
            self.start_teacher_servers(server_cpus)
        if spec.env is not None:
            self.start_env_servers(server_cpus)
        if r.servers:
            return list(r.servers)
        launcher = None
        if r.engine == "sglang":
            from megarl.rollout.sglang_local import SGLangLauncher
            # the feature flags (config/server_flags.feature_flags): routes, LoRA, the memory saver
            launcher = SGLangLauncher(spec.model_path, [*spec.server_flags, *r.server_args], threads=r.server_threads,
                                      api_key=r.api_key)
        self.local = LocalServers(spec.model_path, r.local_servers, f"{spec.run_dir}/servers",
                                  extra=["--threads", r.server_threads, *spec.server_flags, *r.server_args],
                                  host=serving_host(),
                                  weights_roots=[spec.weights.disk_dir or f"{spec.run_dir}/weights"],
                                  cpus=server_cpus, launcher=launcher, ready_timeout_s=r.health_timeout_s,
                                  api_key=r.api_key)
        return self.stack.enter_context(self.local)

    def start_reward_servers(self, cpus) -> None:
        """reward.model's servers, watched and restarted; the reward (RewardModel) is pointed at them."""
        from megarl.common.net import serving_host
        from megarl.rollout.reward_servers import RewardServers, with_reward_urls

        spec = self.spec
        self.reward_servers = RewardServers(spec.reward_model, f"{spec.run_dir}/reward_servers", serving_host(),
                                            cpus, ready_timeout_s=spec.rollout.health_timeout_s)
        urls = self.stack.enter_context(self.reward_servers)
        key = self.reward_servers.api_key
        self.spec = dataclasses.replace(spec, controller=with_reward_urls(spec.controller, urls, key),
                                        eval=with_reward_urls(spec.eval, urls, key))

    def start_teacher_servers(self, cpus) -> None:
        """teacher's servers (megarl-server on teacher.path), watched and restarted like the
        reward model's; the controller scores each group with them (`megarl.rollout.teacher`)."""
        from megarl.common.net import serving_host
        from megarl.rollout.reward_servers import RewardServers

        from megarl.config import RewardModelConfig

        spec, t = self.spec, self.spec.teacher
        # the serving fields in the shape RewardServers takes (the same servers, another model)
        served = RewardModelConfig(path=t.path, servers=t.servers, threads=t.threads,
                                   health_interval_s=t.health_interval_s)
        self.teacher_servers = RewardServers(served, f"{spec.run_dir}/teacher_servers", serving_host(),
                                             cpus, ready_timeout_s=spec.rollout.health_timeout_s, field="teacher.path")
        urls = self.stack.enter_context(self.teacher_servers)
        teacher = {"addresses": list(urls), "api_key": self.teacher_servers.api_key,
                   "timeout_s": spec.teacher.timeout_s}
        self.spec = dataclasses.replace(spec, controller=dataclasses.replace(spec.controller, teacher=teacher))

    def start_env_servers(self, cpus) -> None:
        """env.cls's servers (megarl-env), watched and restarted; the workflows' tasks point at them."""
        from megarl.common.net import serving_host
        from megarl.rollout.env_servers import env_servers
        from megarl.rollout.setup import env_spec

        spec = self.spec
        self.env_servers = env_servers(spec.env, f"{spec.run_dir}/env_servers", serving_host(), cpus,
                                       ready_timeout_s=spec.rollout.health_timeout_s)
        urls = self.stack.enter_context(self.env_servers)
        env = env_spec(urls, self.env_servers.api_key, spec.env)
        c, e = spec.controller, spec.eval
        controller = dataclasses.replace(c, task=dataclasses.replace(c.task, env=env))
        self.spec = dataclasses.replace(spec, controller=controller,
                                        eval=dataclasses.replace(e, task=dataclasses.replace(e.task, env=env)))

    def init(self, msg: Init) -> list[str]:
        from megarl.rollout.cluster import RolloutCluster
        from megarl.rollout.setup import build_controller
        from megarl.common.timeline import Timeline

        if not self._servers_begun:  # a manager built in-process (tests): start them here
            self.begin_servers()
        self._servers_done.wait()  # the main thread may still be starting them (the link beats meanwhile)
        if self._servers_error is not None:
            raise self._servers_error
        servers = self._servers
        self.dp = msg.dp
        self.cluster = RolloutCluster.from_sections(self.spec.rollout, self.spec.weights, servers, driver=True,
                                                    pause_mode=self.spec.wire and self.spec.wire.pause_mode)
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
        from megarl.rollout.setup import build_eval, eval_reward

        # subscribed before the controller starts: no hold/version event can arrive unseen
        self.cluster.subscribe(self.controller)
        self.controller.start()
        self.stack.callback(self.controller.stop)
        self.evaluator = build_eval(self.spec.eval, eval_reward(self.spec.eval.task, self.controller.reward))
        if self.evaluator is not None:  # evaluations run on the controller's loop: it closes their env clients
            self.controller.also_close = self.evaluator.all_workflows()

    # ------------------------------------------------------------------ requests
    def next_batch(self, msg: BatchRequest) -> Batch:
        trajs = self.controller.next_batch(msg.n_groups, timeout_s=msg.timeout_s, version=msg.version)
        c = self.controller
        # stats at hand-off time: the step logs what the rollouts had done when its batch was ready
        stats = {**c.stats(), "rollout/busy_s": c.client.busy_seconds(),
                 "rollout/tokens": c.client.stats["tokens"],
                 "rollout/live_servers": len(self.cluster.addresses),
                 "rollout/dead_servers": len(self.cluster.dead)}
        if self.local is not None:
            stats["rollout/restarts"] = self.local.restarts
        if self.reward_servers is not None:
            stats["reward/server_restarts"] = self.reward_servers.restarts
        if self.teacher_servers is not None:
            stats["teacher/server_restarts"] = self.teacher_servers.restarts
        if self.env_servers is not None:
            stats["env/server_restarts"] = self.env_servers.restarts
        return pack_batch(trajs, self.dp, stats, self.cluster.ready_to_rejoin())

    def admin(self, msg):
        msg = dataclasses.replace(msg, **{f.name: from_wire(getattr(msg, f.name)) for f in dataclasses.fields(msg)})
        # weight loads are counted so that finish_push publishes only after every bucket is in
        update = isinstance(msg, _LOADS)
        if update:
            with self._updates:
                self._inflight += 1
        try:
            return self.cluster.admin.request(msg)  # megarl.rollout.admin.ADMIN_CALLS
        finally:
            if update:
                with self._updates:
                    self._inflight -= 1
                    self._updates.notify_all()

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
        if isinstance(msg, ADMIN_MESSAGES):
            return self.admin(msg)
        if isinstance(msg, CLUSTER_MESSAGES):
            return CLUSTER_CALLS[type(msg)](msg, self)
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

    def close(self) -> None:
        self.stack.close()


PROG = "megarl-rollout-manager"


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise ValueError(text)
    return port


_port.__name__ = "port (0-65535)"  # argparse's one line: "invalid port (0-65535) value: '70000'"


def _secret(args, cfg) -> bytes:
    """From the spawning trainer's pipe, or the user's file when started apart."""
    if args.secret_fd is not None:
        return handshake.read_secret_fd(args.secret_fd)
    path = cfg.rollout.manager_secret_file
    if not path:
        raise ConfigError("rollout.manager_secret_file: a manager started apart needs the run's secret in a "
                          "file only you can read, named in the config (the trainer reads the same file)")
    try:
        return handshake.read_secret_file(path)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _listen(host: str, port: int) -> socket.socket:
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise ConfigError(f"--host {host} --port {port}: cannot listen ({e.strerror or e})") from None


def main(argv: Optional[list[str]] = None) -> int:
    from megarl.common.cli import ArgumentParser, add_debug_flag, pop_debug, run_main
    from megarl.common.errors import ConfigError as _ConfigError

    argv, debug = pop_debug(sys.argv[1:] if argv is None else argv)
    ap = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("config", help="the run's resolved config.yaml")
    ap.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    ap.add_argument("--port", type=_port, default=0, help="0: the OS picks one (printed)")
    ap.add_argument("--secret-fd", type=int, default=None, help=argparse.SUPPRESS)  # set by the spawning trainer
    add_debug_flag(ap)
    args = ap.parse_args(argv)
    return run_main(PROG, lambda: _run(args), debug, expected=(_ConfigError,), code=2)


def _run(args) -> int:
    from megarl.config import load_config
    from megarl.config.server_wire import is_resolved
    from megarl.rollout.local import key_run_servers
    from megarl.rollout.probe import check_wire

    from megarl.common.signals import dump_stacks_on_sigusr2

    logging.basicConfig(level=logging.WARNING, format="[manager] %(levelname)s %(message)s")
    dump_stacks_on_sigusr2()  # kill -USR2: its threads' stacks in manager.log
    cfg = load_config(args.config)
    key_run_servers(cfg.rollout, cfg.train.run_dir)  # before anything reads rollout.api_key
    if not is_resolved(cfg.weights):
        # a manager run apart on the user's config: the wire from what the servers advertise, as
        # the trainer's preflight chooses it (a config megarl-train saved is resolved already)
        check_wire(cfg)
    secret = _secret(args, cfg)
    spec = ManagerSpec.from_config(cfg)
    # nothing heavy runs here: the cores are the trainer's and the servers'. The manager itself
    # never imports torch (~1.8 s before it could listen); a plugin that does gets one thread, and
    # so do the processes it starts that do not set their own (megarl-server sets --threads).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the controller's loop thread holds the GIL most of the time; a trainer request waiting in a
    # connection thread gets it within ~1 ms instead of the default 5 ms switch interval
    sys.setswitchinterval(0.001)
    listener = _listen(args.host, args.port)
    host, port = listener.getsockname()[:2]
    print(f"listening {host}:{port}", flush=True)
    os.dup2(2, 1)  # the spawner reads that one line; everything else goes to the manager's log
    manager = RolloutManager(spec)
    # links are served (handshake, Hello) while the servers start: a trainer left in the listen
    # backlog for a slow server start (SGLang: 30-90 s) would time out its handshake; its Init
    # waits for the servers, with heartbeats
    accepting = threading.Thread(target=serve_forever, args=(manager, listener, secret), name="megarl-accept")
    accepting.start()
    manager.begin_servers()  # on the main thread, which lives as long as the run (PR_SET_PDEATHSIG)
    try:
        accepting.join()
    finally:
        listener.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
