"""megarl-launch: what every node and rank of an allocation runs, planned without starting anything.

    megarl-launch --dry-run configs/recipe.yaml [a.b=c ...] --trainer-nodes gpu[01-04] \\
        --rollout-nodes gpu[05-08] --gpus-per-node 8 [--launcher srun|torchrun|mpirun]

The planner is pure (no process, no network): from the config (parallel.tp/pp, launch.*,
weights.dtype, rollout.server_threads) and an :class:`Allocation` it derives

- rollout servers: per rollout node ``servers_per_node`` servers on consecutive ports from
  launch.server_port, each on its own GPUs (CUDA_VISIBLE_DEVICES), as SGLang or megarl-server
  commands bound to the node's address; optionally SGLang's router on the first rollout node;
- trainer ranks: world = trainer nodes x ranks per node, DP = world / (TP*PP); rank r runs on
  trainer node r // ranks_per_node (block placement: what srun, torchrun and mpirun do) and has
  Megatron's default coordinates (order tp-cp-ep-dp-pp, TP fastest): r = tp + TP*(dp + DP*pp).
  The rank with tp = dp = 0 of each pipeline stage is that stage's weight source;
- the trainer launch: one srun or mpirun for all trainer nodes, or one torchrun per node, with
  MASTER_ADDR = the first trainer node's address, and rollout.servers=[...] appended.

Bad input is one line naming the flag or field, exit status 2, and never a hang: hostlists are
expanded strictly (megarl/launch/hostlist.py: malformed or backwards ranges, unbalanced brackets, more
than 65536 hosts), counts per node are bounded (MAX_PER_NODE) and so is the world (MAX_RANKS),
ports lie in 1..65535 (a node's servers take consecutive ports from launch.server_port).

launch/slurm.sbatch executes what ``--emit servers`` and ``--emit trainer`` print, so a dry run
shows exactly the commands a job runs. ``--get KEY[,KEY]`` prints resolved config values.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass, field
from typing import Optional

from megarl.config.server_flags import feature_flags

LAUNCHERS = ("srun", "torchrun", "mpirun")
MAX_PER_NODE = 1024  # GPUs or ranks of one node: far above any machine, low enough to plan fast
MAX_RANKS = 1 << 18  # trainer ranks of one job (a plan lists every rank)


class PlanError(ValueError):
    """The allocation cannot run the config; the message says which number does not fit."""


@dataclass(frozen=True)
class Allocation:
    trainer_nodes: tuple[str, ...]
    rollout_nodes: tuple[str, ...] = ()
    gpus_per_node: int = 0
    """GPUs of each trainer node; 0 = CPU nodes."""
    rollout_gpus_per_node: Optional[int] = None
    """GPUs of each rollout node; default gpus_per_node."""
    tasks_per_node: int = 0
    """Trainer ranks per node; 0 = one per GPU (GPU nodes) or TP*PP spread over the nodes (CPU)."""
    node_addrs: tuple[tuple[str, str], ...] = ()
    """(node, address) pairs where a node name does not resolve (e.g. SLURM's NodeAddr)."""
    master_port: int = 29500
    launcher: str = "srun"
    log_dir: str = ""
    """srun only: trainer output to <log_dir>/trainer.log (appended across requeues)."""
    python: str = "python"

    def addr(self, node: str) -> str:
        return dict(self.node_addrs).get(node, node)


@dataclass(frozen=True)
class ServerLaunch:
    node: str
    index: int
    host: str
    port: int
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def command(self) -> str:
        return " ".join([f"{k}={shlex.quote(v)}" for k, v in self.env] + [shlex.join(self.argv)])


@dataclass(frozen=True)
class RankLaunch:
    rank: int
    node: str
    node_index: int
    local_rank: int
    tp: int
    pp: int
    dp: int
    cp: int = 0

    @property
    def roles(self) -> list[str]:
        out = ["starts the rollout manager"] if self.rank == 0 else []
        if self.tp == 0 and self.dp == 0 and self.cp == 0:
            out.append(f"weights source of stage {self.pp}")
        return out


@dataclass
class Plan:
    alloc: Allocation
    tp: int
    pp: int
    dp: int
    ranks_per_node: int
    master_addr: str
    server_kind: str
    servers: list[ServerLaunch]
    router: Optional[ServerLaunch]
    ranks: list[RankLaunch]
    launches: list[tuple[Optional[str], tuple[str, ...]]] = field(default_factory=list)
    """(node or None for "from the batch host", argv) per trainer launch command."""
    cp: int = 1

    @property
    def world(self) -> int:
        return len(self.ranks)


def rank_coords(rank: int, tp: int, pp: int, dp: int, cp: int = 1) -> tuple[int, int, int, int]:
    """(tp_rank, pp_rank, dp_rank, cp_rank) of a global rank in Megatron's default order
    tp-cp-ep-dp-pp (tp fastest)."""
    assert 0 <= rank < tp * pp * dp * cp, (rank, tp, pp, dp, cp)
    return rank % tp, rank // (tp * cp * dp), rank // (tp * cp) % dp, rank // tp % cp


# ----------------------------------------------------------------------------- planning

def serving_dtype(cfg) -> str:
    return cfg.model.dtype if cfg.weights.dtype == "auto" else cfg.weights.dtype


def plan_servers(cfg, alloc: Allocation) -> tuple[str, list[ServerLaunch]]:
    """(server kind, servers) for the rollout nodes."""
    L = cfg.launch
    gpus = alloc.gpus_per_node if alloc.rollout_gpus_per_node is None else alloc.rollout_gpus_per_node
    kind = L.server if L.server != "auto" else ("sglang" if gpus > 0 else "megarl")
    per_server = L.server_tp * L.server_dp if kind == "sglang" else 0
    if per_server and gpus:
        n = L.servers_per_node or gpus // per_server
        if n < 1 or n * per_server > gpus:
            raise PlanError(f"launch.servers_per_node: {n} servers x {per_server} GPUs (server_tp * "
                            f"server_dp) do not fit a rollout node's {gpus} GPUs")
    else:
        n = L.servers_per_node or 1
    if L.server_port + n - 1 > 65535:
        raise PlanError(f"launch.server_port: {L.server_port} + {n} servers per node runs past port 65535")
    # what the run's features need of its servers (routes, LoRA, memory saver): as the local servers get them
    flags = feature_flags(cfg, kind, gpu=gpus > 0)
    servers = []
    for node in alloc.rollout_nodes:
        host = alloc.addr(node)
        for i in range(n):
            port = L.server_port + i
            env: tuple = ()
            if kind == "sglang":
                argv = ["-m", "sglang.launch_server", "--model-path", cfg.model.hf_path,
                        "--host", host, "--port", str(port), "--tp-size", str(L.server_tp)]
                if L.server_dp > 1:
                    argv += ["--dp-size", str(L.server_dp)]
                argv += ["--dtype", serving_dtype(cfg)]
                if gpus:
                    env = (("CUDA_VISIBLE_DEVICES", ",".join(str(g) for g in range(i * per_server,
                                                                                    (i + 1) * per_server))),)
            else:
                argv = ["-m", "megarl.server", "--model", cfg.model.hf_path,
                        "--host", host, "--port", str(port), "--dtype", serving_dtype(cfg),
                        "--threads", str(cfg.rollout.server_threads)]
            argv = keyed_argv(alloc.python, argv + flags + list(L.server_args), key_file(cfg))
            servers.append(ServerLaunch(node, i, host, port, tuple(argv), env))
    return kind, servers


def key_file(cfg) -> str:
    """The key of the servers megarl-launch plans: rollout.api_key_file, or <run_dir>/servers/api_key
    (written by ``--emit servers``; the run directory is on the file system every node shares)."""
    return cfg.rollout.api_key_file or os.path.abspath(os.path.join(cfg.train.run_dir, "servers", "api_key"))


def keyed_argv(python: str, module_args: list[str], path: str) -> list[str]:
    """The command of a planned server keyed by the file ``path``: megarl-server reads
    --api-key-file itself; SGLang and its router take --api-key on argv only, which /proc shows
    every user of the node, so they start through KEYED_LAUNCH, which reads the file."""
    from megarl.rollout.sglang_local import keyed

    if module_args[1] == "megarl.server":
        return [python, *module_args, "--api-key-file", path]
    return keyed(python, module_args, path)


def write_server_key(cfg) -> None:
    """Makes the planned servers' key file (mode 0600, directory 0700, a fresh file each time: a
    requeued job's servers get a new key): rollout.api_key when set, else a random key. A file
    the user named in rollout.api_key_file is theirs, read, never written."""
    if cfg.rollout.api_key_file:
        return
    import secrets

    from megarl.rollout.local import write_key_file

    write_key_file(key_file(cfg), cfg.rollout.api_key or secrets.token_urlsafe(32))


def plan_router(cfg, alloc: Allocation, servers: list[ServerLaunch]) -> Optional[ServerLaunch]:
    L = cfg.launch
    if not L.router or not servers:
        return None
    node = alloc.rollout_nodes[0]
    host = alloc.addr(node)
    argv = ["-m", "sglang_router.launch_router", "--worker-urls", *[s.url for s in servers],
            "--host", host, "--port", str(L.router_port), "--policy", L.router_policy]
    # the router checks the key of its clients and sends it on to the workers of --worker-urls
    return ServerLaunch(node, 0, host, L.router_port, tuple(keyed_argv(alloc.python, argv, key_file(cfg))))


def plan_ranks(cfg, alloc: Allocation) -> tuple[int, list[RankLaunch]]:
    """(ranks per node, ranks) with their Megatron coordinates."""
    tp, pp, cp = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp
    mp = cfg.parallel.model_parallel
    nodes = alloc.trainer_nodes
    if not nodes:
        raise PlanError("allocation: no trainer nodes")
    per_node = alloc.tasks_per_node or alloc.gpus_per_node
    if not per_node:  # CPU nodes, nothing said: the smallest world that fits TP*PP
        per_node = max(1, -(-(cfg.parallel.world_size or mp) // len(nodes)))
    world = per_node * len(nodes)
    if world > MAX_RANKS:
        raise PlanError(f"allocation: {len(nodes)} trainer nodes x {per_node} ranks = {world} ranks, more than "
                        f"{MAX_RANKS}")
    if world % mp:
        raise PlanError(f"allocation: {len(nodes)} trainer nodes x {per_node} ranks = {world} ranks is "
                        f"not divisible by parallel.tp * parallel.pp * parallel.cp = {mp}")
    if cfg.parallel.world_size and cfg.parallel.world_size != world:
        raise PlanError(f"parallel.world_size: {cfg.parallel.world_size}, but the allocation gives "
                        f"{world} trainer ranks")
    dp = world // mp
    ranks = []
    for r in range(world):
        t, p, d, c = rank_coords(r, tp, pp, dp, cp)
        ranks.append(RankLaunch(r, nodes[r // per_node], r // per_node, r % per_node, t, p, d, c))
    return per_node, ranks


def trainer_argv(cfg, alloc: Allocation, config_path: str, overrides: list[str],
                 servers: list[ServerLaunch]) -> list[str]:
    argv = [alloc.python, "-m", "megarl.train", config_path, *overrides]
    if servers:
        argv.append("rollout.servers=[" + ",".join(s.url for s in servers) + "]")
        if not cfg.rollout.api_key_file:
            argv.append(f"rollout.api_key_file={key_file(cfg)}")
    return argv


def plan_launches(alloc: Allocation, per_node: int, master: str, argv: list[str]
                  ) -> list[tuple[Optional[str], tuple[str, ...]]]:
    nodes, port = alloc.trainer_nodes, alloc.master_port
    if alloc.launcher == "srun":
        # --ntasks too: inside a batch job srun would take the job's SLURM_NTASKS as its default
        cmd = ["srun", f"--nodes={len(nodes)}", f"--ntasks={per_node * len(nodes)}",
               f"--ntasks-per-node={per_node}",
               f"--nodelist={','.join(nodes)}", "--label", "--kill-on-bad-exit=1"]
        if alloc.log_dir:
            cmd += [f"--output={alloc.log_dir}/trainer.log", "--open-mode=append"]
        cmd += [f"--export=ALL,MASTER_ADDR={master},MASTER_PORT={port}", *argv]
        return [(None, tuple(cmd))]
    if alloc.launcher == "mpirun":
        hosts = ",".join(f"{alloc.addr(n)}:{per_node}" for n in nodes)
        cmd = ["mpirun", "-np", str(per_node * len(nodes)), "--host", hosts,
               "-x", f"MASTER_ADDR={master}", "-x", f"MASTER_PORT={port}", "-x", "PATH", "-x", "PYTHONPATH",
               *argv]
        return [(None, tuple(cmd))]
    out = []
    for i, node in enumerate(nodes):
        cmd = [alloc.python, "-m", "torch.distributed.run", f"--nnodes={len(nodes)}", f"--node-rank={i}",
               f"--nproc-per-node={per_node}", f"--master-addr={master}", f"--master-port={port}",
               "-m", "megarl.train", *argv[3:]]
        out.append((node, tuple(cmd)))
    return out


def check_numbers(cfg, alloc: Allocation) -> None:
    """Every count and port of the allocation means something before anything is planned (and
    the plan stays small enough to print: no node has more than MAX_PER_NODE GPUs or ranks)."""
    for flag, value in (("--gpus-per-node", alloc.gpus_per_node), ("--tasks-per-node", alloc.tasks_per_node),
                        ("--rollout-gpus-per-node", alloc.rollout_gpus_per_node)):
        if value is not None and not 0 <= value <= MAX_PER_NODE:
            raise PlanError(f"{flag}: must be in [0, {MAX_PER_NODE}], got {value}")
    if not 1 <= alloc.master_port <= 65535:
        raise PlanError(f"--master-port: must be in [1, 65535], got {alloc.master_port}")
    if alloc.gpus_per_node and alloc.tasks_per_node > alloc.gpus_per_node:
        raise PlanError(f"--tasks-per-node: {alloc.tasks_per_node} ranks would share the node's "
                        f"{alloc.gpus_per_node} GPUs (--gpus-per-node)")
    if not alloc.gpus_per_node and cfg.model.dtype == "bfloat16" and alloc.trainer_nodes:
        raise PlanError("--gpus-per-node: 0 (CPU trainer nodes), but model.dtype=bfloat16 needs GPUs")
    rollout_gpus = alloc.gpus_per_node if alloc.rollout_gpus_per_node is None else alloc.rollout_gpus_per_node
    if alloc.rollout_nodes and cfg.launch.server == "sglang" and not rollout_gpus:
        raise PlanError("--rollout-gpus-per-node: 0 (CPU rollout nodes), but launch.server=sglang needs GPUs; "
                        "use launch.server=megarl or auto")
    known = set(alloc.trainer_nodes) | set(alloc.rollout_nodes)
    for node, _ in alloc.node_addrs:
        if node not in known:
            raise PlanError(f"--node-addr: {node} is neither a trainer nor a rollout node")
    if rollout_gpus and set(alloc.trainer_nodes) & set(alloc.rollout_nodes):
        both = sorted(set(alloc.trainer_nodes) & set(alloc.rollout_nodes))[0]
        raise PlanError(f"--rollout-nodes: {both} is also a trainer node; on GPU nodes the servers and the "
                        "trainer ranks would claim the same GPUs")


def check_ports(cfg, servers: list[ServerLaunch]) -> None:
    """The router's port is not one of the servers' on its node (plan_servers bounds their range)."""
    L = cfg.launch
    if L.router and any(s.port == L.router_port and s.node == servers[0].node for s in servers):
        raise PlanError(f"launch.router_port: {L.router_port} is also a server's port on {servers[0].node}")


def make_plan(cfg, config_path: str, overrides: list[str], alloc: Allocation) -> Plan:
    if alloc.launcher not in LAUNCHERS:
        raise PlanError(f"--launcher: one of {', '.join(LAUNCHERS)}; got {alloc.launcher!r}")
    check_numbers(cfg, alloc)
    if alloc.rollout_nodes and cfg.rollout.servers:
        raise PlanError("rollout.servers: set by the launcher from the rollout nodes; leave it empty "
                        "or give no rollout nodes")
    kind, servers = plan_servers(cfg, alloc)
    check_ports(cfg, servers)
    per_node, ranks = plan_ranks(cfg, alloc)
    master = alloc.addr(alloc.trainer_nodes[0])
    plan = Plan(alloc, cfg.parallel.tp, cfg.parallel.pp, len(ranks) // cfg.parallel.model_parallel,
                per_node, master, kind, servers, plan_router(cfg, alloc, servers), ranks, cp=cfg.parallel.cp)
    plan.launches = plan_launches(alloc, per_node, master, trainer_argv(cfg, alloc, config_path, overrides, servers))
    return plan


# ----------------------------------------------------------------------------- output

def rank_env(plan: Plan, r: RankLaunch) -> str:
    w, a = plan.world, plan.alloc
    if a.launcher == "srun":
        pairs = [("SLURM_PROCID", r.rank), ("SLURM_LOCALID", r.local_rank), ("SLURM_NODEID", r.node_index),
                 ("SLURM_NTASKS", w)]
    elif a.launcher == "mpirun":
        pairs = [("OMPI_COMM_WORLD_RANK", r.rank), ("OMPI_COMM_WORLD_LOCAL_RANK", r.local_rank),
                 ("OMPI_COMM_WORLD_SIZE", w)]
    else:
        pairs = [("RANK", r.rank), ("LOCAL_RANK", r.local_rank), ("WORLD_SIZE", w)]
    pairs += [("MASTER_ADDR", plan.master_addr), ("MASTER_PORT", a.master_port)]
    return " ".join(f"{k}={v}" for k, v in pairs)


def render(plan: Plan) -> list[str]:
    """The dry run: a summary, every server, every trainer launch, every rank."""
    a = plan.alloc
    lines = [f"# trainer: {len(a.trainer_nodes)} node(s) x {plan.ranks_per_node} ranks = {plan.world} ranks "
             f"(tp={plan.tp} pp={plan.pp}{f' cp={plan.cp}' if plan.cp > 1 else ''} dp={plan.dp}), "
             f"{a.launcher}, rendezvous "
             f"{plan.master_addr}:{a.master_port}"]
    if plan.servers:
        per = len(plan.servers) // len(a.rollout_nodes)
        lines.append(f"# rollout: {len(a.rollout_nodes)} node(s) x {per} servers = {len(plan.servers)} "
                     f"{plan.server_kind} servers")
    else:
        lines.append("# rollout: no rollout nodes (rollout.servers from the config, or servers started "
                     "by rank 0)")
    for s in plan.servers:
        lines.append(f"server {s.node} #{s.index} {s.url}: {s.command}")
    if plan.router is not None:
        lines.append(f"router {plan.router.node} {plan.router.url}: {plan.router.command}")
    for node, argv in plan.launches:
        lines.append(f"trainer{' ' + node if node else ''}: {shlex.join(argv)}")
    for r in plan.ranks:
        roles = f" [{', '.join(r.roles)}]" if r.roles else ""
        cp = f" cp {r.cp}" if plan.cp > 1 else ""
        lines.append(f"rank {r.rank} {r.node} local {r.local_rank} tp {r.tp} pp {r.pp}{cp} dp {r.dp}{roles}: "
                     f"{rank_env(plan, r)}")
    return lines


def emit(plan: Plan, what: str) -> list[str]:
    """Machine-readable lines for launch/slurm.sbatch: ``servers`` -> NODE<TAB>URL<TAB>COMMAND
    (the router last, as node "router:<node>"); ``trainer`` -> [NODE<TAB>]COMMAND."""
    if what == "servers":
        out = [f"{s.node}\t{s.url}\t{s.command}" for s in plan.servers]
        if plan.router is not None:
            out.append(f"router:{plan.router.node}\t{plan.router.url}\t{plan.router.command}")
        return out
    return [(f"{node}\t" if node else "") + shlex.join(argv) for node, argv in plan.launches]


# ----------------------------------------------------------------------------- CLI

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megarl-launch", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--dry-run", action="store_true", help="print the plan for the allocation")
    mode.add_argument("--emit", choices=("servers", "trainer"), help="machine-readable plan lines")
    mode.add_argument("--get", metavar="KEY[,KEY]", help="print resolved config values, one per line "
                      "(e.g. train.run_dir,launch.health_timeout_s)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="a.b=c config overrides")
    p.add_argument("--trainer-nodes", default="", help="SLURM hostlist, e.g. gpu[01-04]")
    p.add_argument("--rollout-nodes", default="", help="SLURM hostlist of rollout nodes (may be empty)")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per trainer node (0 = CPU)")
    p.add_argument("--rollout-gpus-per-node", type=int, default=None, help="default --gpus-per-node")
    p.add_argument("--tasks-per-node", type=int, default=0, help="trainer ranks per node (default: GPUs)")
    p.add_argument("--node-addr", action="append", default=[], metavar="NODE=ADDR",
                   help="address of a node whose name does not resolve (repeatable)")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--launcher", default="srun", choices=LAUNCHERS)
    p.add_argument("--log-dir", default="", help="srun: trainer log directory")
    p.add_argument("--python", default="python", help="interpreter name in the commands")
    return p.parse_intermixed_args(argv)


def hosts(flag: str, text: str) -> tuple[str, ...]:
    """The expanded hostlist of a flag; PlanError naming the flag when it is malformed."""
    from megarl.launch.hostlist import expand_nodelist

    if not text:
        return ()
    try:
        return tuple(expand_nodelist(text))
    except ValueError as e:
        raise PlanError(f"{flag}: {e}") from None


def allocation_from_args(args: argparse.Namespace) -> Allocation:
    addrs = []
    for item in args.node_addr:
        node, sep, addr = item.partition("=")
        if not sep or not node or not addr:
            raise PlanError(f"--node-addr: expected NODE=ADDR, got {item!r}")
        addrs.append((node, addr))
    return Allocation(
        trainer_nodes=hosts("--trainer-nodes", args.trainer_nodes),
        rollout_nodes=hosts("--rollout-nodes", args.rollout_nodes),
        gpus_per_node=args.gpus_per_node, rollout_gpus_per_node=args.rollout_gpus_per_node,
        tasks_per_node=args.tasks_per_node, node_addrs=tuple(addrs), master_port=args.master_port,
        launcher=args.launcher, log_dir=args.log_dir, python=args.python)


def get_value(cfg, key: str):
    node = cfg
    for part in key.split("."):
        if not hasattr(node, part):
            raise PlanError(f"--get: {key}: no field {part!r}")
        node = getattr(node, part)
    return node


def main(argv: Optional[list[str]] = None) -> int:
    from megarl.config import ConfigError, load_config
    from megarl.models.checks import check_against_model

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.get:  # reading fields needs the recipe only, not the model
            print("\n".join(str(get_value(cfg, key)) for key in args.get.split(",")))
            return 0
        check_against_model(cfg)  # the plan places ranks by TP/PP/EP: they must fit the model
        plan = make_plan(cfg, args.config, args.overrides, allocation_from_args(args))
        if args.emit == "servers" and plan.servers:
            try:
                write_server_key(cfg)
            except OSError as e:
                raise PlanError(f"train.run_dir: cannot write the servers' key {key_file(cfg)} "
                                f"({e.strerror or e})") from None
    except (ConfigError, PlanError) as e:
        print(f"megarl-launch: {e}", file=sys.stderr)
        return 2
    print("\n".join(render(plan) if args.dry_run else emit(plan, args.emit)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
