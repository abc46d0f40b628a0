"""rollout.placement: colocated combinations that cannot work are refused at load, naming the fields."""
import pytest

from megarl.config import ConfigError, load_config

BASE = ["model.hf_path=m", "data.train_path=x.jsonl", "rollout.placement=colocated", "rollout.max_staleness=0"]


def load(*overrides):
    return load_config(None, [*BASE, *overrides])


def test_colocated_loads_on_policy_with_local_servers():
    cfg = load("weights.transport=shm")
    assert cfg.rollout.placement == "colocated" and cfg.rollout.sleep_tags == ["kv_cache", "weights"]


@pytest.mark.parametrize("overrides, message", [
    (["rollout.max_staleness=1"], "rollout.placement: colocated is on-policy"),
    (["rollout.servers=[http://127.0.0.1:9]"], "rollout.placement: colocated starts its servers"),
    (["train.trigger_parameter_sync_step=2"], "train.trigger_parameter_sync_step: rollout.placement=colocated"),
    (["rollout.sleep_tags=[gpu]"], "rollout.sleep_tags: unknown ['gpu']"),
    (["rollout.placement=hybrid"], "rollout.placement"),
    (["rollout.placement=disaggregated", "weights.transport=shm", "rollout.servers=[http://10.1.2.3:9]"],
     "weights.transport: shm hands the weights over in this host's memory"),
])
def test_combinations_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(").replace(")", r"\)")):
        load(*overrides)


def test_the_cuda_ipc_wire_refuses_host_tensors():
    import torch

    from megarl.protocol.tensor_wire import tensor_update

    with pytest.raises(ValueError, match="^sglang_ipc: w is not a CUDA tensor"):
        tensor_update({"w": torch.ones(2)}, "sglang_ipc")


def test_the_cuda_ipc_wire_pickles_with_torchs_reducers():
    """The pickling under `encode_sglang_ipc` (whose CUDA tensors only a GPU has): torch's reducers
    turn a tensor into a handle to its memory, here a CPU tensor's shared memory, opened in process."""
    import pickle

    import torch

    from megarl.protocol.tensor_wire import fork_pickle

    w = torch.arange(6.0)
    (name, opened), = pickle.loads(fork_pickle([("w", w)]))
    assert name == "w" and torch.equal(opened, w) and opened.is_shared()
