"""train.torch_threads auto (megarl/trainer/threads.py): a trainer rank's share of the cores its
local servers leave, the servers' cores for an update while they idle, and the trainer's cores for
the servers while it waits - each only when measured faster so."""
import pytest
import torch

from megarl.config import load_config
from megarl.trainer import threads as T
from megarl.trainer.threads import ThreadSplit, ranks_on_node

DEMO = "configs/tiny_grpo.yaml"


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.setattr(T, "node_cores", lambda: 4)


@pytest.fixture(autouse=True)
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("overrides,rank,world,env,want", [
    ([], 0, 1, {}, (3, 1)),  # one local server of one thread: the rest is the trainer's
    (["rollout.server_threads=2"], 0, 1, {}, (2, 2)),
    (["rollout.local_servers=2", "rollout.server_threads=2"], 0, 1, {}, (1, 4)),  # at least one
    (["rollout.servers=[127.0.0.1:9]"], 0, 1, {}, (4, 0)),  # remote servers: every core, nothing to borrow
    ([], 0, 2, {"LOCAL_WORLD_SIZE": "2"}, (1, 0)),  # two ranks beside the server: fixed
    ([], 2, 4, {"LOCAL_WORLD_SIZE": "2"}, (2, 0)),  # a rank of the second node: no server there
    (["train.algorithm=sft"], 0, 1, {}, (4, 0)),
    ([], 0, 1, {"OMP_NUM_THREADS": "2"}, (2, 1)),  # the launcher's or the user's cap on its own share
])
def test_a_rank_owns_what_the_local_servers_leave(four_cores, overrides, rank, world, env, want):
    cfg = load_config(DEMO, ["train.torch_threads=auto", *overrides], validate=False)
    split = ThreadSplit.for_run(cfg, rank, world, env)
    assert (split.own, split.borrow) == want


@pytest.mark.parametrize("overrides,want", [
    ([], (3, 1)),  # megarl-server may take the trainer's 3 cores while it waits
    (["rollout.local_servers=2", "rollout.server_threads=1"], (1, 1)),  # shared out per server (at least 0)
    (["rollout.server_threads=2"], (2, 2)),
    (["rollout.engine=sglang"], (0, 1)),  # SGLang cannot change its threads while serving
    (["rollout.server_cpus=[1]"], (0, 1)),  # pinned servers cannot use another core
])
def test_what_the_servers_may_take_while_the_trainer_waits(four_cores, overrides, want):
    cfg = load_config(DEMO, ["train.torch_threads=auto", *overrides], validate=False)
    split = ThreadSplit.for_run(cfg, 0, 1, {})
    assert (split.lend, split.server_threads) == want
    if "rollout.server_cpus=[1]" in overrides:
        assert split.borrow == 0  # nor can the update use the pinned servers' core


def test_a_set_count_is_no_split():
    assert load_config(DEMO, []).train.torch_threads == 1  # the demo recipe's
    assert ThreadSplit.for_run(load_config(DEMO, ["train.torch_threads=0"]), 0, 1, {}) is None
    assert load_config(DEMO, ["train.torch_threads=auto"]).train.torch_threads is None


@pytest.mark.parametrize("env,world,want", [({"LOCAL_WORLD_SIZE": "4"}, 8, 4), ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 8, 2),
                                            ({"SLURM_NTASKS_PER_NODE": "2(x3)"}, 6, 2), ({}, 3, 3)])
def test_ranks_on_the_node(env, world, want):
    assert ranks_on_node(world, env) == want


def _step(split, idle, seconds_per_token):
    n = split.before_update()
    assert torch.get_num_threads() == n
    split.after_update()
    assert torch.get_num_threads() == split.own
    return n, split.observe(idle, seconds_per_token[n] * 1000, 1000)


def test_busy_servers_keep_their_cores(capsys):
    split = ThreadSplit(own=1, borrow=1)
    for _ in range(20):
        n, metrics = _step(split, 0.2, {1: 1e-4, 2: 5e-5})
        assert n == 1
    assert metrics == {"trainer/update_threads": 1, "trainer/servers_idle": pytest.approx(0.2)}
    assert "busy 80% of the recent steps: they keep their core(s)" in split.reason
    assert capsys.readouterr().out.count("[megarl] update threads") == 1  # printed when it changes


@pytest.mark.parametrize("costs,settles", [({1: 1e-4, 2: 5e-5}, 2), ({1: 1e-4, 2: 1.2e-4}, 1),
                                           ({1: 1e-4, 2: 0.95e-4}, 1)])  # 5% cheaper: not worth the contention
def test_idle_servers_lend_their_cores_only_to_a_faster_update(costs, settles):
    split = ThreadSplit(own=1, borrow=1)
    _step(split, 0.7, costs)  # the first step: the servers' idle share not measured yet
    split.steps = 0
    counts = [_step(split, 0.7, costs)[0] for _ in range(T.RETRY_EVERY + T.TRIALS + 10)]
    assert counts[:T.TRIALS] == [1, 2] * (T.TRIALS // 2)  # both measured first, alternating
    assert set(counts[T.TRIALS:T.RETRY_EVERY]) == {settles}
    assert counts[T.RETRY_EVERY:T.RETRY_EVERY + T.TRIALS] == [1, 2] * (T.TRIALS // 2)  # again every RETRY_EVERY
    assert split.reason.endswith(f"(median of the last trials) at 1: 100.0 us, 2: {1e6 * costs[2]:.1f} us")


def test_noisy_trials_decide_by_their_medians():
    """One slow outlier at two threads does not decide; the medians of the window do."""
    split = ThreadSplit(own=1, borrow=1)
    split.idle = 0.8
    two = iter([5e-5, 9e-4, 5e-5, 5e-5])
    for _ in range(T.TRIALS):
        n = split.before_update()
        split.after_update()
        split.observe(0.8, (next(two) if n == 2 else 1e-4) * 1000, 1000)
    assert split.update_trial.choice == 2 and split.update_trial.cost == {1: 1e-4, 2: 5e-5}


def test_a_fixed_split_never_borrows():
    split = ThreadSplit(own=2, borrow=0)
    assert [_step(split, 0.9, {2: 1e-4})[0] for _ in range(10)] == [2] * 10
    assert split.reason.startswith("a fixed split")


class Servers:
    """What the manager relays to the local servers (megarl-server's /set_threads): each count set."""

    def __init__(self, fail_at=None):
        self.sent, self.fail_at = [], fail_at

    def __call__(self, n):
        if self.fail_at is not None and len(self.sent) == self.fail_at:
            raise RuntimeError("/set_threads: 404")
        self.sent.append(n)


def _wait_step(split, waited, seconds_per_token):
    """One step: the wait (servers' count for it, then back), the update, the measurements."""
    with split.waiting() as n:
        pass
    split.before_update()
    split.after_update()
    split.observe(0.1, 1.0, 1000, waited, seconds_per_token[n] * 1000)
    return n


@pytest.mark.parametrize("costs,settles", [({1: 2e-3, 2: 1.4e-3}, 2), ({1: 2e-3, 2: 1.9e-3}, 1)])
def test_a_waiting_trainer_lends_its_core_only_to_faster_generation(costs, settles):
    servers = Servers()
    split = ThreadSplit(own=1, borrow=1, lend=1, server_threads=1, send=servers)
    _wait_step(split, 0.45, costs)  # the first step: the trainer's idle share not measured yet
    split.steps = 0
    counts = [_wait_step(split, 0.45, costs) for _ in range(T.RETRY_EVERY + 2 * T.TRIALS)]
    # the wait's window follows the update's, so the two never alternate in the same steps
    assert counts[:T.TRIALS] == [1] * T.TRIALS
    assert counts[T.TRIALS:2 * T.TRIALS] == [1, 2] * (T.TRIALS // 2)
    assert set(counts[2 * T.TRIALS:T.RETRY_EVERY + T.TRIALS]) == {settles}
    assert split.wait_trial.cost == pytest.approx(costs)
    # each lent wait sets the servers to 2 and back to 1 before the update; nothing is sent otherwise
    assert servers.sent == [2, 1] * counts.count(2)
    assert split.wait_reason.startswith("the trainer waited 45% of the recent steps")


def test_a_trainer_that_never_waits_keeps_its_core():
    servers = Servers()
    split = ThreadSplit(own=1, borrow=1, lend=1, server_threads=1, send=servers)
    assert [_wait_step(split, 0.1, {1: 1e-3, 2: 1e-4}) for _ in range(40)] == [1] * 40
    assert servers.sent == [] and "it keeps its core(s)" in split.wait_reason
    assert split.observe(0.1, 1.0, 1000, 0.1, 1.0)["trainer/wait_server_threads"] == 1


def test_servers_that_refuse_end_the_lending(capsys):
    servers = Servers(fail_at=0)
    split = ThreadSplit(own=1, borrow=0, lend=1, server_threads=1, send=servers)
    split.waited, split.steps = 0.6, T.TRIALS + 1  # a lending trial step
    with split.waiting() as n:
        assert n == 2
    assert split.lend == 0 and split.send is None
    assert "no more lending this run" in capsys.readouterr().out
    assert _wait_step(split, 0.6, {1: 1e-3}) == 1 and servers.sent == []


def test_a_restarted_server_is_set_again():
    servers = Servers()
    split = ThreadSplit(own=1, borrow=0, lend=1, server_threads=1, send=servers)
    split._set_servers(2)
    split._set_servers(2)  # already there: nothing sent
    split.server_restarted()
    split._set_servers(2)
    assert servers.sent == [2, 2]
