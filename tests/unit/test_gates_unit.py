"""The run-time gates in their pure parts: the on-policy mismatch statistic, the gate's threshold
by dtype and its one-line error, checksum verification's warn / fail handling, the config rules."""
from types import SimpleNamespace

import pytest
import torch

from megarl.algo import onpolicy_mismatch
from megarl.config import Config, ConfigError, load_config
from megarl.trainer.metrics import StatsTracker
from megarl.models.random_hf import tiny_config, write_random_hf
from megarl.trainer.actor import Actor, _Clock
from megarl.trainer.batch import MicroBatch
from megarl.trainer.gates import MismatchError, check_mismatch, mismatch_threshold, verify_push
from megarl.weights.transports import PushError
from megarl.protocol.wire import tensor_digest

MASK = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]])
VERSIONS = torch.tensor([[-1, 5, 5, 5], [-1, -1, 5, 4]])  # row 0 wholly version 5, row 1 spans a push
TRAINER = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, 0.0, -1.0, -3.0]])
BEHAVE = torch.tensor([[0.0, -1.0, -2.25, -0.5], [0.0, 0.0, -0.875, -2.0]])


def test_onpolicy_mismatch_counts_only_samples_wholly_of_the_current_version():
    s = onpolicy_mismatch(TRAINER, BEHAVE, VERSIONS, MASK, 5.0)
    # row 0's loss tokens: |-1 + 1| = 0, |-2 + 2.25| = 0.25, |-0.5 + 0.5| = 0; row 1's version-5
    # token (|-1 + 0.875| = 0.125) is left out: its prefix's KV may come from version 4's weights
    assert s["mismatch/mean"].result() == pytest.approx(0.25 / 3)
    assert s["mismatch/max"].result() == pytest.approx(0.25)
    assert s["mismatch/onpolicy_frac"].result() == pytest.approx(3 / 5)
    none = onpolicy_mismatch(TRAINER, BEHAVE, VERSIONS, MASK, 6.0)  # nothing on-policy yet
    assert none["mismatch/mean"].result() == none["mismatch/max"].result() == 0.0
    assert none["mismatch/onpolicy_frac"].result() == 0.0


def test_loss_fn_reports_the_mismatch_at_the_first_optimizer_step_without_prox():
    cfg = Config()
    cfg.algo.prox_logp_mode = "loglinear"
    cfg.algo.behave_weight_cap = None
    actor = Actor(cfg, ps=None, engine=None)
    fields = {"loss_mask": MASK, "behave_logp": BEHAVE, "advantages": torch.ones(2, 4),
              "versions": VERSIONS.float(), "loss_weight": MASK / 5}
    z = torch.zeros(2, 4, dtype=torch.long)
    mb = MicroBatch(z, z, fields, torch.full((2,), 4), torch.arange(2), 5.0)
    for k, reported in ((0, True), (1, False)):
        acc = StatsTracker()
        actor._loss_fn(_Clock(k=k, total=2, prox_version=5.0), acc, TRAINER.clone(), None, mb)
        assert ("mismatch/mean" in acc.stats) == reported
    acc = StatsTracker()
    actor._loss_fn(_Clock(k=0, total=2, prox_version=5.0), acc, TRAINER.clone(), None, mb)
    assert acc.stats["mismatch/max"].result() == pytest.approx(0.25)
    assert acc.stats["logp_gap_max"].result() == pytest.approx(1.0)  # the stale token counts there


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return write_random_hf(str(tmp_path_factory.mktemp("hf")), tiny_config())


def load(hf, *overrides):
    return load_config(None, [f"model.hf_path={hf}", "data.train_path=x.jsonl", *overrides])


def test_threshold_by_dtype(hf):
    assert mismatch_threshold(load(hf)) == 1e-4
    assert mismatch_threshold(load(hf, "weights.dtype=bfloat16")) == 5e-2
    assert mismatch_threshold(load(hf, "train.mismatch_threshold=0.3")) == 0.3
    assert mismatch_threshold(load(hf, "train.mismatch_gate=false")) is None


def test_gate_raises_one_line_naming_the_numbers_and_causes():
    row = {"mismatch/mean": 2.5e-3, "mismatch/max": 0.04, "mismatch/onpolicy_frac": 0.5}
    with pytest.raises(MismatchError) as e:
        check_mismatch(1e-4, row, step=3, version=2)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("train.mismatch_gate: at step 3")
    assert "version 2" in msg and "0.0025 > 0.0001" in msg and "max 0.04" in msg
    for cause in ("conversion", "tokenizer", "chat template", "dtype"):
        assert cause in msg
    check_mismatch(1e-2, row, 3, 2)  # under the threshold
    check_mismatch(None, row, 3, 2)  # gate off
    check_mismatch(1e-4, {**row, "mismatch/onpolicy_frac": 0.0}, 3, 2)  # no on-policy token


class FakePusher:
    def __init__(self, bad):
        self.bad, self.version, self.ps = bad, 7, SimpleNamespace(rank=0)

    def verify(self):
        return self.bad


def test_verify_push_warns_or_fails(capsys):
    bad = ["http://127.0.0.1:3001:model.norm.weight", "http://127.0.0.1:3001:lm_head.weight"]
    assert verify_push(FakePusher([]), "fail") == 0
    assert verify_push(FakePusher(bad), "warn") == 2
    assert "model.norm.weight" in capsys.readouterr().out
    with pytest.raises(PushError) as e:
        verify_push(FakePusher(bad), "fail")
    msg = str(e.value)
    assert "\n" not in msg
    assert "server http://127.0.0.1:3001 holds a different model.norm.weight" in msg
    assert "version 7" in msg and "2 tensor(s) differ on 1 server(s)" in msg


def test_verify_config(hf):
    """verify_interval auto is resolved against the servers (tests/unit/test_server_wire.py);
    explicit values stand, and the wire plan refuses a count not resolved yet, not guessed."""
    from megarl.protocol.wire_plan import WirePlan

    resolved = ["weights.tensor_format=megarl", "weights.pause_mode=abort"]
    assert WirePlan.decide(load(hf, "weights.verify_interval=0", *resolved).weights).verify_every == 0
    assert WirePlan.decide(load(hf, "weights.verify_interval=3", *resolved).weights).verify_every == 3
    assert load(hf, "weights.verify_interval=auto").weights.verify_interval is None
    with pytest.raises(ValueError, match="weights.verify_interval: auto was not resolved against the servers"):
        WirePlan.decide(load(hf, *resolved).weights)
    with pytest.raises(ConfigError, match="weights.verify_mode"):
        load(hf, "weights.verify_mode=ignore")
