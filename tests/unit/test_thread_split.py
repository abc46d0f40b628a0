"""train.torch_threads auto (megarl/trainer/threads.py): a trainer rank's share of the cores its
local servers leave, and the servers' cores for an update while they idle - only when the update
measured faster so."""
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
    assert split.choice == 2 and split.cost == {1: 1e-4, 2: 5e-5}


def test_a_fixed_split_never_borrows():
    split = ThreadSplit(own=2, borrow=0)
    assert [_step(split, 0.9, {2: 1e-4})[0] for _ in range(10)] == [2] * 10
    assert split.reason.startswith("a fixed split")
