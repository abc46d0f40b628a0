"""megarl-launch: the exact commands planned for a few allocations, Megatron's rank layout, errors."""
import json
import os
import re
import shlex
import stat
import subprocess
import sys

import pytest

from megarl.config import ConfigError, load_config
from megarl.launch.plan import Allocation, PlanError, emit, make_plan, rank_coords, render
from megarl.rollout.sglang_local import KEYED_LAUNCH

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "configs", "tiny_grpo.yaml")
TINY = os.path.join(REPO, "examples", "tiny", "model")


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """config.json of an 8B-shaped Llama (32 heads, 8 KV heads, 32 layers): enough to validate."""
    d = tmp_path_factory.mktemp("llama8b")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}))
    return str(d)


def key_of(overrides) -> str:
    """The key file megarl-launch plans for a run of DEMO with ``overrides``."""
    return os.path.abspath(os.path.join(load_config(DEMO, overrides).train.run_dir, "servers", "api_key"))


def keyed(module: str, key: str) -> str:
    """How a planned SGLang server or router starts: KEYED_LAUNCH reads --api-key from the key file."""
    return f"python -c {shlex.quote(KEYED_LAUNCH)} {module} {key}"


def plan_lines(overrides, **alloc):
    cfg = load_config(DEMO, overrides)
    return render(make_plan(cfg, "configs/tiny_grpo.yaml", overrides, Allocation(**alloc)))


def test_cpu_demo_one_rollout_node_one_trainer_node():
    ov = [f"model.hf_path={TINY}", "train.steps=3", "parallel.pp=2"]
    lines = plan_lines(ov, trainer_nodes=("n2",), rollout_nodes=("n1",), tasks_per_node=2,
                       node_addrs=(("n1", "127.0.0.2"), ("n2", "127.0.0.3")), master_port=20007,
                       log_dir="runs/x/logs")
    assert lines == [
        "# trainer: 1 node(s) x 2 ranks = 2 ranks (tp=1 pp=2 dp=1), srun, rendezvous 127.0.0.3:20007",
        "# rollout: 1 node(s) x 1 servers = 1 megarl servers",
        f"server n1 #0 http://127.0.0.2:30000: python -m megarl.server --model {TINY} "
        f"--host 127.0.0.2 --port 30000 --dtype float32 --threads 1 --api-key-file {key_of(ov)}",
        "trainer: srun --nodes=1 --ntasks=2 --ntasks-per-node=2 --nodelist=n2 --label --kill-on-bad-exit=1 "
        "--output=runs/x/logs/trainer.log --open-mode=append --export=ALL,MASTER_ADDR=127.0.0.3,"
        f"MASTER_PORT=20007 python -m megarl.train configs/tiny_grpo.yaml model.hf_path={TINY} "
        f"train.steps=3 parallel.pp=2 'rollout.servers=[http://127.0.0.2:30000]' rollout.api_key_file={key_of(ov)}",
        "rank 0 n2 local 0 tp 0 pp 0 dp 0 [starts the rollout manager, weights source of stage 0]: SLURM_PROCID=0 "
        "SLURM_LOCALID=0 SLURM_NODEID=0 SLURM_NTASKS=2 MASTER_ADDR=127.0.0.3 MASTER_PORT=20007",
        "rank 1 n2 local 1 tp 0 pp 1 dp 0 [weights source of stage 1]: SLURM_PROCID=1 SLURM_LOCALID=1 "
        "SLURM_NODEID=0 SLURM_NTASKS=2 MASTER_ADDR=127.0.0.3 MASTER_PORT=20007",
    ]


def test_four_trainer_four_rollout_nodes_tp4_pp2_rollout_tp2(big):
    ov = [f"model.hf_path={big}", "model.dtype=bfloat16", "parallel.tp=4", "parallel.pp=2",
          "launch.server_tp=2"]
    lines = plan_lines(ov, trainer_nodes=("gpu01", "gpu02", "gpu03", "gpu04"),
                       rollout_nodes=("gpu05", "gpu06", "gpu07", "gpu08"), gpus_per_node=8)
    servers = [x for x in lines if x.startswith("server ")]
    ranks = [x for x in lines if x.startswith("rank ")]
    assert len(lines) == 2 + 16 + 1 + 32 and len(servers) == 16 and len(ranks) == 32
    assert lines[0] == ("# trainer: 4 node(s) x 8 ranks = 32 ranks (tp=4 pp=2 dp=4), srun, "
                        "rendezvous gpu01:29500")
    assert lines[1] == "# rollout: 4 node(s) x 4 servers = 16 sglang servers"
    sglang = keyed("sglang.launch_server", key_of(ov))
    assert servers[0] == (f"server gpu05 #0 http://gpu05:30000: CUDA_VISIBLE_DEVICES=0,1 {sglang} "
                          f"--model-path {big} --host gpu05 --port 30000 --tp-size 2 --dtype bfloat16")
    assert servers[15] == (f"server gpu08 #3 http://gpu08:30003: CUDA_VISIBLE_DEVICES=6,7 {sglang} "
                           f"--model-path {big} --host gpu08 --port 30003 --tp-size 2 --dtype bfloat16")
    urls = ",".join(f"http://gpu0{n}:3000{i}" for n in (5, 6, 7, 8) for i in range(4))
    assert lines[18] == (
        "trainer: srun --nodes=4 --ntasks=32 --ntasks-per-node=8 --nodelist=gpu01,gpu02,gpu03,gpu04 --label "
        "--kill-on-bad-exit=1 --export=ALL,MASTER_ADDR=gpu01,MASTER_PORT=29500 python -m megarl.train "
        f"configs/tiny_grpo.yaml model.hf_path={big} model.dtype=bfloat16 parallel.tp=4 parallel.pp=2 "
        f"launch.server_tp=2 'rollout.servers=[{urls}]' rollout.api_key_file={key_of(ov)}")
    env = "SLURM_NTASKS=32 MASTER_ADDR=gpu01 MASTER_PORT=29500"
    assert ranks[0] == ("rank 0 gpu01 local 0 tp 0 pp 0 dp 0 [starts the rollout manager, weights source of stage 0]: "
                        f"SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NODEID=0 {env}")
    assert ranks[5] == f"rank 5 gpu01 local 5 tp 1 pp 0 dp 1: SLURM_PROCID=5 SLURM_LOCALID=5 SLURM_NODEID=0 {env}"
    assert ranks[16] == ("rank 16 gpu03 local 0 tp 0 pp 1 dp 0 [weights source of stage 1]: SLURM_PROCID=16 "
                         f"SLURM_LOCALID=0 SLURM_NODEID=2 {env}")
    assert ranks[31] == ("rank 31 gpu04 local 7 tp 3 pp 1 dp 3: SLURM_PROCID=31 SLURM_LOCALID=7 "
                         f"SLURM_NODEID=3 {env}")


def test_torchrun_and_mpirun_launch_lines(big):
    ov = [f"model.hf_path={big}", "parallel.tp=2", "parallel.pp=2"]
    alloc = dict(trainer_nodes=("a", "b"), gpus_per_node=8, master_port=29600,
                 node_addrs=(("a", "10.0.0.1"), ("b", "10.0.0.2")))
    lines = plan_lines(ov, launcher="torchrun", **alloc)
    assert lines[0] == ("# trainer: 2 node(s) x 8 ranks = 16 ranks (tp=2 pp=2 dp=4), torchrun, "
                        "rendezvous 10.0.0.1:29600")
    assert lines[1] == ("# rollout: no rollout nodes (rollout.servers from the config, or servers started "
                        "by rank 0)")
    tail = f"-m megarl.train configs/tiny_grpo.yaml model.hf_path={big} parallel.tp=2 parallel.pp=2"
    assert lines[2:4] == [
        f"trainer a: python -m torch.distributed.run --nnodes=2 --node-rank=0 --nproc-per-node=8 "
        f"--master-addr=10.0.0.1 --master-port=29600 {tail}",
        f"trainer b: python -m torch.distributed.run --nnodes=2 --node-rank=1 --nproc-per-node=8 "
        f"--master-addr=10.0.0.1 --master-port=29600 {tail}"]
    assert lines[4 + 9] == ("rank 9 b local 1 tp 1 pp 1 dp 0: RANK=9 LOCAL_RANK=1 WORLD_SIZE=16 "
                            "MASTER_ADDR=10.0.0.1 MASTER_PORT=29600")
    lines = plan_lines(ov, launcher="mpirun", **alloc)
    assert lines[2] == ("trainer: mpirun -np 16 --host 10.0.0.1:8,10.0.0.2:8 -x MASTER_ADDR=10.0.0.1 "
                        "-x MASTER_PORT=29600 -x PATH -x PYTHONPATH python -m megarl.train "
                        f"configs/tiny_grpo.yaml model.hf_path={big} parallel.tp=2 parallel.pp=2")
    assert lines[3 + 8] == ("rank 8 b local 0 tp 0 pp 1 dp 0 [weights source of stage 1]: "
                            "OMPI_COMM_WORLD_RANK=8 OMPI_COMM_WORLD_LOCAL_RANK=0 OMPI_COMM_WORLD_SIZE=16 "
                            "MASTER_ADDR=10.0.0.1 MASTER_PORT=29600")


def test_sglang_router_and_dp_servers(big):
    ov = [f"model.hf_path={big}", "parallel.tp=8", "launch.server_tp=2", "launch.server_dp=2",
          "launch.router=true", "launch.server_args=[--mem-fraction-static,'0.8']"]
    cfg = load_config(DEMO, ov)
    plan = make_plan(cfg, "c.yaml", ov, Allocation(("t1",), ("r1", "r2"), gpus_per_node=8))
    assert [s.url for s in plan.servers] == ["http://r1:30000", "http://r1:30001", "http://r2:30000",
                                             "http://r2:30001"]
    assert plan.servers[1].command == (
        f"CUDA_VISIBLE_DEVICES=4,5,6,7 {keyed('sglang.launch_server', key_of(ov))} --model-path {big} --host r1 "
        "--port 30001 --tp-size 2 --dp-size 2 --dtype float32 --mem-fraction-static 0.8")
    assert emit(plan, "servers")[-1] == (
        f"router:r1\thttp://r1:30100\t{keyed('sglang_router.launch_router', key_of(ov))} --worker-urls "
        "http://r1:30000 http://r1:30001 http://r2:30000 http://r2:30001 --host r1 --port 30100 --policy cache_aware")
    assert emit(plan, "servers")[0].split("\t")[:2] == ["r1", "http://r1:30000"]


@pytest.mark.parametrize("overrides, alloc, message", [
    (["parallel.tp=4", "parallel.pp=2"], dict(trainer_nodes=("a",), tasks_per_node=4),
     "allocation: 1 trainer nodes x 4 ranks = 4 ranks is not divisible by parallel.tp * parallel.pp * parallel.cp = 8"),
    (["launch.server_tp=4", "launch.servers_per_node=3"], dict(trainer_nodes=("a",), rollout_nodes=("r",),
                                                                gpus_per_node=8),
     "launch.servers_per_node: 3 servers x 4 GPUs (server_tp * server_dp) do not fit a rollout node's 8 GPUs"),
    (["rollout.servers=[http://x:1]"], dict(trainer_nodes=("a",), rollout_nodes=("r",)),
     "rollout.servers: set by the launcher from the rollout nodes"),
    (["parallel.world_size=4"], dict(trainer_nodes=("a", "b"), tasks_per_node=1),
     "parallel.world_size: 4, but the allocation gives 2 trainer ranks"),
])
def test_allocations_that_do_not_fit(big, overrides, alloc, message):
    cfg = load_config(DEMO, [f"model.hf_path={big}", *overrides])
    with pytest.raises(PlanError, match=re.escape(message)):
        make_plan(cfg, "c.yaml", [], Allocation(**alloc))


def test_launch_config_validation():
    with pytest.raises(ConfigError, match="launch.server: must be one of auto, sglang, megarl"):
        load_config(DEMO, [f"model.hf_path={TINY}", "launch.server=vllm"])
    with pytest.raises(ConfigError, match="launch.router: SGLang's router fronts SGLang servers"):
        load_config(DEMO, [f"model.hf_path={TINY}", "launch.server=megarl", "launch.router=true"])
    cfg = load_config(DEMO, [f"model.hf_path={TINY}"])
    assert cfg.weights.master_address == "auto" and cfg.checkpoint.save_interval == 10


@pytest.mark.parametrize("tp, pp, dp, cp", [(1, 1, 4, 1), (2, 2, 2, 1), (4, 2, 4, 1), (2, 4, 1, 1), (8, 1, 2, 1),
                                            (1, 1, 2, 2), (2, 2, 2, 2), (2, 1, 1, 4)])
def test_rank_coords_follow_megatron(tp, pp, dp, cp):
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    for dim, index in (("tp", 0), ("pp", 1), ("dp", 2), ("cp", 3)):
        for group in gen.get_ranks(dim):
            for position, rank in enumerate(group):
                assert rank_coords(rank, tp, pp, dp, cp)[index] == position, (dim, group, rank)


def test_dry_run_counts_context_parallel_ranks(big):
    cfg = load_config(DEMO, [f"model.hf_path={big}", "parallel.tp=2", "parallel.cp=2"])
    plan = make_plan(cfg, "c.yaml", [], Allocation(trainer_nodes=("a", "b"), tasks_per_node=4))
    lines = render(plan)
    assert "= 8 ranks (tp=2 pp=1 cp=2 dp=2)" in lines[0]
    ranks = [line for line in lines if line.startswith("rank ")]
    assert ranks[0].startswith("rank 0 a local 0 tp 0 pp 0 cp 0 dp 0 [starts the rollout manager, weights "
                               "source of stage 0]:")
    assert ranks[2].startswith("rank 2 a local 2 tp 0 pp 0 cp 1 dp 0:")  # the same replica's other half
    assert ranks[4].startswith("rank 4 b local 0 tp 0 pp 0 cp 0 dp 1:")
    with pytest.raises(PlanError, match=re.escape("= 6 ranks is not divisible by parallel.tp * parallel.pp * "
                                                  "parallel.cp = 4")):
        make_plan(cfg, "c.yaml", [], Allocation(trainer_nodes=("a", "b"), tasks_per_node=3))


def test_cli_dry_run_emit_and_get(tmp_path):
    base = [sys.executable, "-m", "megarl.launch.plan"]
    args = [DEMO, f"model.hf_path={TINY}", "train.run_dir=r", "--trainer-nodes", "n[2-3]",
            "--rollout-nodes", "n1", "--node-addr", "n1=127.0.0.2", "--tasks-per-node", "1"]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = lambda *a: subprocess.run(base + list(a), capture_output=True, text=True, env=env, cwd=str(tmp_path))
    key = tmp_path / "r" / "servers" / "api_key"
    assert run("--dry-run", *args).returncode == 0 and not key.exists()  # a dry run writes nothing
    out = run("--emit", "servers", *args)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"n1\thttp://127.0.0.2:30000\tpython -m megarl.server --model {TINY} --host 127.0.0.2 "
        f"--port 30000 --dtype float32 --threads 1 --api-key-file {key}"]
    # the servers' key: made by --emit servers, the user's alone, fresh at each emit (a requeued job)
    first = key.read_text()
    assert len(first) >= 32 and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    assert run("--emit", "servers", *args).returncode == 0 and key.read_text() != first
    out = run("--emit", "trainer", *args)
    assert out.stdout.startswith("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist=n2,n3 ")
    assert out.stdout.rstrip().endswith(f" rollout.api_key_file={key}")
    # rollout.api_key given: the file holds it (the trainer, reading the file, finds the same key)
    assert run("--emit", "servers", *args, "rollout.api_key=k" + "x" * 20).returncode == 0
    assert key.read_text() == "k" + "x" * 20
    out = run("--get", "train.run_dir,launch.health_timeout_s", *args[:3])
    assert out.stdout.splitlines() == ["r", "900.0"]
    out = run("--dry-run", DEMO, f"model.hf_path={TINY}", "parallel.tp=2", "--trainer-nodes", "a",
              "--tasks-per-node", "3")
    assert out.returncode == 2
    assert out.stderr.strip() == ("megarl-launch: allocation: 1 trainer nodes x 3 ranks = 3 ranks is not "
                                  "divisible by parallel.tp * parallel.pp * parallel.cp = 2")


def test_cli_get_reads_the_recipe_only_and_the_plan_checks_the_model(tmp_path):
    base = [sys.executable, "-m", "megarl.launch.plan", DEMO, f"model.hf_path={tmp_path}/absent"]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(base + ["--get", "parallel.tp"], capture_output=True, text=True, env=env)
    assert (out.returncode, out.stdout.splitlines()) == (0, ["1"]), out.stderr
    out = subprocess.run(base + ["--dry-run", "--trainer-nodes", "a", "--tasks-per-node", "1"],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 2
    assert out.stderr.strip() == f"megarl-launch: model.hf_path: no config.json in '{tmp_path}/absent'"


@pytest.mark.parametrize("text, hosts", [
    ("gpu[01-03,07],cpu1", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("gpu[01-02]-ib", ["gpu01-ib", "gpu02-ib"]),
    (" a, b[2] ", ["a", "b2"]),
])
def test_hostlists(text, hosts):
    from megarl.launch.hostlist import expand_nodelist

    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text, message", [
    ("gpu[05-01]", "'gpu[05-01]': range 05-01 runs backwards"),
    ("gpu[a-b]", "'gpu[a-b]': [a-b] is not a list of numbers and ranges like 01-04"),
    ("gpu[01-03", "'gpu[01-03': unclosed '['"),
    ("gpu01-03]", "'gpu01-03]': ']' without '['"),
    ("gpu[[1]]", "'gpu[[1]]': nested '['"),
    ("gpu[1--3]", "is not a list of numbers"),
    ("gpu[]", "is not a list of numbers"),
    ("a,,b", "'a,,b': empty host name"),
    ("", "'': empty host name"),
    ("[1-2]", "'[1-2]': no name around the range"),
    ("gpu 01", "host names may hold letters, digits"),
    ("a,b,a", "'a,b,a': a is listed twice"),
    ("n[1-2],n[2-3]", "n2 is listed twice"),
    ("gpu[0-99999999999999]", "more than 65536 hosts"),
    ("a[0-999]b[0-999]", "more than 65536 hosts"),
])
def test_malformed_hostlists(text, message):
    from megarl.launch.hostlist import expand_nodelist

    with pytest.raises(ValueError) as e:
        expand_nodelist(text)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, alloc, message", [
    ([], dict(trainer_nodes=("a",), gpus_per_node=-8), "--gpus-per-node: must be in [0, 1024], got -8"),
    ([], dict(trainer_nodes=("a",), tasks_per_node=-1), "--tasks-per-node: must be in [0, 1024], got -1"),
    ([], dict(trainer_nodes=("a",), tasks_per_node=10**9), "--tasks-per-node: must be in [0, 1024]"),
    ([], dict(trainer_nodes=("a",), rollout_nodes=("r",), rollout_gpus_per_node=-1),
     "--rollout-gpus-per-node: must be in [0, 1024], got -1"),
    ([], dict(trainer_nodes=("a",), master_port=70000), "--master-port: must be in [1, 65535], got 70000"),
    ([], dict(trainer_nodes=("a",), master_port=0), "--master-port: must be in [1, 65535], got 0"),
    ([], dict(trainer_nodes=("a",), gpus_per_node=8, tasks_per_node=16),
     "--tasks-per-node: 16 ranks would share the node's 8 GPUs"),
    (["model.dtype=bfloat16"], dict(trainer_nodes=("a",)), "--gpus-per-node: 0 (CPU trainer nodes), but "
                                                           "model.dtype=bfloat16 needs GPUs"),
    (["launch.server=sglang"], dict(trainer_nodes=("a",), rollout_nodes=("r",)),
     "--rollout-gpus-per-node: 0 (CPU rollout nodes), but launch.server=sglang needs GPUs"),
    ([], dict(trainer_nodes=("a",), node_addrs=(("zz", "10.0.0.9"),)), "--node-addr: zz is neither"),
    ([], dict(trainer_nodes=("a", "b"), rollout_nodes=("b",), gpus_per_node=8),
     "--rollout-nodes: b is also a trainer node"),
    (["launch.server_port=65535", "launch.servers_per_node=2"], dict(trainer_nodes=("a",), rollout_nodes=("r",)),
     "launch.server_port: 65535 + 2 servers per node runs past port 65535"),
    (["launch.server_port=30000", "launch.servers_per_node=100000"], dict(trainer_nodes=("a",), rollout_nodes=("r",)),
     "launch.server_port: 30000 + 100000 servers per node runs past port 65535"),
    (["launch.router=true", "launch.server=sglang", "launch.router_port=30001", "launch.server_tp=2"],
     dict(trainer_nodes=("a",), rollout_nodes=("r",), gpus_per_node=8),
     "launch.router_port: 30001 is also a server's port on r"),
    (["parallel.world_size=1000000000"], dict(trainer_nodes=("a",)),
     "allocation: 1 trainer nodes x 1000000000 ranks = 1000000000 ranks, more than 262144"),
])
def test_numbers_that_cannot_mean_anything(big, overrides, alloc, message):
    cfg = load_config(DEMO, [f"model.hf_path={big}", *overrides])
    with pytest.raises(PlanError) as e:
        make_plan(cfg, "c.yaml", [], Allocation(**alloc))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("args, message", [
    (["--trainer-nodes", "gpu[05-01]"], "megarl-launch: --trainer-nodes: 'gpu[05-01]': range 05-01 runs backwards"),
    (["--trainer-nodes", "a", "--rollout-nodes", "gpu[a-b]"], "megarl-launch: --rollout-nodes: 'gpu[a-b]': [a-b]"),
    (["--trainer-nodes", "gpu[0-99999999999999]"], "megarl-launch: --trainer-nodes: 'gpu[0-99999999999999]': "
                                                   "more than 65536 hosts"),
    (["--trainer-nodes", "a", "--tasks-per-node", "1000000000"], "megarl-launch: --tasks-per-node: must be in"),
    (["--trainer-nodes", "a", "--master-port", "99999"], "megarl-launch: --master-port: must be in [1, 65535]"),
    (["--trainer-nodes", "a", "launch.server_port=0"], "megarl-launch: launch.server_port: must be >= 1 and "
                                                       "<= 65535, got 0"),
])
def test_cli_refuses_bad_allocations_in_one_line(args, message):
    # each of these hung, made a traceback or planned nonsense before; now: one line, exit 2, fast
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "megarl.launch.plan", "--dry-run", DEMO, f"model.hf_path={TINY}",
                          *args], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().startswith(message) and len(out.stderr.strip().splitlines()) == 1, out.stderr
