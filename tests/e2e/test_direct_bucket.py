"""The distributed transport's "direct_bucket" against a real megarl-server, with tensors large
enough (>= 1 MiB) to be received straight into the server's parameters: a good bucket makes every
server tensor equal the sent one bitwise (server checksums); a bucket announcing an unknown name
is received in full (the trainer's broadcasts return), refused, and writes no parameter."""
import pytest
import torch

from megarl.models.random_hf import tiny_config, write_random_hf
from megarl.protocol.messages import WeightsChecksum
from megarl.rollout.admin import AdminRunner
from megarl.server.weights import read_hf_dir
from megarl.weights.resharder import Bucket
from megarl.weights.transports import DistributedTransport, PushError
from megarl.protocol.wire import DIRECT_MIN_BYTES, direct_split, tensor_digest


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("direct")
    # embedding 2048 x 256 fp32 = 2 MiB, gate/up/down 1024 x 256 = 1 MiB: direct; norms packed
    cfg = tiny_config(hidden_size=256, vocab_size=2048, intermediate_size=1024, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    return write_random_hf(str(d / "a"), cfg, seed=1), read_hf_dir(write_random_hf(str(d / "b"), cfg, seed=2))


def _checksums(admin, names):
    got = admin.request(WeightsChecksum(names, ["float32"] * len(names)), 60)
    return next(iter(got.values()))


def test_direct_bucket_in_place_and_bad_name(models, start_server):
    path_a, new = models
    server = start_server(path_a)
    admin = AdminRunner([server.url], None, 60)
    tr = DistributedTransport(admin, "127.0.0.1", 60, "gloo", wire="megarl")
    try:
        tr.setup(0)
        names = sorted(new)
        tensors = [new[n].contiguous() for n in names]
        direct, packed = direct_split(["float32"] * len(names), [list(t.shape) for t in tensors])
        assert len(direct) >= 4 and packed  # both paths are exercised
        assert all(tensors[i].numel() * 4 >= DIRECT_MIN_BYTES for i in direct)
        before = _checksums(admin, names)

        bad = Bucket(names + ["model.layers.9.bogus.weight"], tensors + [torch.zeros(512, 256)])
        with pytest.raises(PushError, match="bogus"):
            tr.send(bad, "1")
        assert _checksums(admin, names) == before  # nothing written in place by a refused bucket

        tr.send(Bucket(names, tensors), "1")
        assert _checksums(admin, names) == {n: tensor_digest(t) for n, t in zip(names, tensors)}
        assert before != _checksums(admin, names)
    finally:
        tr.close()
        admin.close()


def test_sglang_flattened_bucket_into_megarl_server(models, start_server):
    """The wire megarl sends real SGLang (one "flattened_bucket" broadcast, SGLang's back-to-back
    layout) lands bitwise in megarl-server too: what a mixed server set is sent."""
    path_a, new = models
    server = start_server(path_a)
    admin = AdminRunner([server.url], None, 60)
    tr = DistributedTransport(admin, "127.0.0.1", 60, "gloo", wire="sglang")
    try:
        tr.setup(0)
        names = sorted(new)
        tensors = [new[n].contiguous() for n in names]
        before = _checksums(admin, names)
        tr.send(Bucket(names, tensors), "1")
        assert _checksums(admin, names) == {n: tensor_digest(t) for n, t in zip(names, tensors)} != before
    finally:
        tr.close()
        admin.close()
