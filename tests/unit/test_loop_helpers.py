"""Pure pieces of the RL loop: overlong reward shaping applied to a batch, the batch metrics users
tune with, the console line every logging.log_interval steps, and the timeline chart + advice."""
import json

import pytest

from megarl.trainer.metrics import MetricsLogger
from megarl.protocol.packing import pack_batch
from megarl.protocol.types import Trajectory
from megarl.rollout.shaping import GroupShaping
from megarl.trainer.handoff import ReceivedStep
from megarl.trainer.rl import shaping_metrics
from megarl.trainer.rollout_stats import batch_metrics


def traj(n_gen: int, reward: float, versions=None) -> Trajectory:
    vers = versions or [3] * n_gen
    return Trajectory([1] * (2 + n_gen), [0, 0] + [1] * n_gen, [0.0] * (2 + n_gen), [-1, -1] + vers,
                      reward, 0)


def test_overlong_shaping_by_hand():
    shape = GroupShaping(max_new_tokens=8, overlong_buffer_len=4, overlong_penalty_factor=1.0)
    trajs = [traj(4, 1.0), traj(6, 1.0), traj(8, 0.0)]  # max 8 new tokens, buffer 4: free up to 4
    assert shape(trajs)  # no dynamic sampling: every group is kept
    assert [t.reward for t in trajs] == [1.0, 0.5, -1.0]  # -(L - 4) / 4
    assert [t.info["reward_raw"] for t in trajs] == [1.0, 1.0, 0.0]
    out = shaping_metrics([t.info for t in trajs])  # what the trainer logs from the shaped samples it receives
    assert out == {"overlong_penalty_mean": pytest.approx(-0.5), "overlong_frac": pytest.approx(2 / 3)}
    plain = [traj(8, 1.0)]
    assert GroupShaping(8)(plain) and plain[0].reward == 1.0 and "reward_raw" not in plain[0].info  # off
    assert shaping_metrics([t.info for t in plain]) == {}


def test_group_shaping_filters_on_the_shaped_rewards():
    both = GroupShaping(8, overlong_buffer_len=4, dynamic_sampling=True)
    # equal verifier rewards, lengths 4 and 6: shaped 1.0 and 0.5 -> kept (the raw filter dropped it)
    assert both([traj(4, 1.0), traj(6, 1.0)])
    # verifier rewards 1.0 (6 tokens) and 0.5 (4 tokens): shaped 0.5 and 0.5 -> dropped
    assert not both([traj(6, 1.0), traj(4, 0.5)])
    assert not GroupShaping(8, dynamic_sampling=True)([traj(6, 1.0), traj(4, 1.0)])  # filter alone


def test_batch_metrics_staleness_histogram_and_partial_span():
    trajs = [traj(3, 1.0, [5, 5, 5]), traj(3, 0.0, [4, 4, 5]), traj(3, 0.0, [3, 4, 5])]
    m = batch_metrics(received(trajs), version=5)
    assert m["staleness_max"] == 2 and m["staleness_mean"] == 1.0
    assert (m["staleness_hist/0"], m["staleness_hist/1"], m["staleness_hist/2"]) == (1, 1, 1)
    assert m["max_partial_span"] == 3 and m["partial_frac"] == pytest.approx(2 / 3)
    assert m["stale_samples"] == 2 and m["reward"] == pytest.approx(1 / 3)


def received(trajs) -> ReceivedStep:
    """The step as the trainer holds it: the manager's flat arrays."""
    b = pack_batch(trajs, 1, {}, [])
    return ReceivedStep(b.arrays, b.infos)


def test_batch_metrics_counts_samples_without_generated_tokens():
    """The flat-array metrics agree with the per-sample definitions: a sample without generated
    tokens has span 0 and counts as version -1 (stale by version + 1), and response_len is the
    mean count of loss tokens."""
    trajs = [traj(2, 1.0, [4, 5]), Trajectory([1, 2], [0, 0], [0.0, 0.0], [-1, -1], 0.5, 1), traj(1, 0.0, [5])]
    m = batch_metrics(received(trajs), version=5)
    assert m["response_len"] == pytest.approx(1.0) and m["trained_samples"] == 3
    assert m["staleness_max"] == 6 and (m["staleness_hist/0"], m["staleness_hist/1"], m["staleness_hist/6"]) == (1, 1, 1)
    assert m["max_partial_span"] == 2 and m["partial_frac"] == pytest.approx(1 / 3)
    assert m["reward"] == pytest.approx(0.5)


def test_console_line_every_log_interval_steps(tmp_path, capsys):
    log = MetricsLogger(str(tmp_path), tensorboard=False, console_keys=["loss"], console_interval=5,
                        enabled=True)
    for step in range(1, 12):
        log.log({"loss": float(step)}, step)
    log.close()
    assert capsys.readouterr().out.splitlines() == ["step 1 | loss 1", "step 5 | loss 5", "step 10 | loss 10"]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 11  # files: every step


def test_plot_timeline_draws_the_gantt_and_advises(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from plot_timeline_loader import plot_timeline

    d = tmp_path / "run" / "timeline"
    d.mkdir(parents=True)
    spans = []
    for i in range(5):  # the trainer waits 0.8 s of every 1 s step; the server is always busy
        t = 100.0 + i
        spans += [{"name": "wait", "lane": "trainer", "start": t, "end": t + 0.8},
                  {"name": "update", "lane": "trainer", "start": t + 0.8, "end": t + 1.0},
                  {"name": "generate", "lane": "http://127.0.0.1:1", "start": t, "end": t + 1.0}]
    (d / "rank0.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    assert plot_timeline.main([str(tmp_path / "run"), "--last", "0"]) == 0
    out = capsys.readouterr().out
    assert "trainer idle 80.0%, rollout idle 0.0%" in out
    assert "the trainer waits for rollouts" in out
    assert (tmp_path / "run" / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_batch_metrics_trained_length_distribution():
    lengths = [3, 64, 65, 100, 1000, 1025, 8192, 9000]
    trajs = [traj(n, 0.0, [5] * n) for n in lengths]
    m = batch_metrics(received(trajs), version=5)
    assert (m["response_len/min"], m["response_len/max"]) == (3, 9000)
    assert m["response_len/p50"] == pytest.approx((100 + 1000) / 2)  # numpy's linear interpolation
    assert m["response_len/p90"] == pytest.approx(8192 + 0.3 * (9000 - 8192))
    # buckets (upper/2, upper], the first one (0, 64]
    assert {k: v for k, v in m.items() if k.startswith("response_len_hist/")} == {
        "response_len_hist/64": 2, "response_len_hist/128": 2, "response_len_hist/1024": 1,
        "response_len_hist/2048": 1, "response_len_hist/8192": 1, "response_len_hist/16384": 1}
    assert m["response_len"] == pytest.approx(sum(lengths) / len(lengths))
