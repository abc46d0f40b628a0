"""Metrics: the one reducer (StatsTracker over `Stat`s) -- its math, ONE packed DP all_reduce per
reduction kind and the PP broadcast (2 gloo processes) --, the sinks, print0, progress, and
tools/plot_metrics.py."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.algo import Stat
from megarl.trainer.metrics import MetricsLogger, StatsTracker, print0, progress
from megarl.trainer.parallel import ParallelState

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tracker_masked_means_and_reset():
    t = StatsTracker()
    t.add("loss", torch.tensor(6.0), torch.tensor(3))
    t.add("loss", 2.0, 1)  # (6 + 2) / (3 + 1), not the mean of means (2 + 2) / 2
    t.add_scalar("grad_norm", 1.0)
    t.add_scalar("grad_norm", 4.0)
    t.add_masked("adv", torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]),
                 torch.tensor([[1, 1, 0], [0, 0, 1]]))  # (1 + 2 + 6) / 3
    t.add("never", 0.0, 0)  # no items: reported as 0.0 (keys stay stable from step to step)
    with t.scope("ppo"), t.scope("actor"):
        t.add_scalar("clip", 0.25)
    out = t.reduce()  # no parallel state: local results, no communication
    assert out == {"adv": 3.0, "grad_norm": 2.5, "loss": 2.0, "never": 0.0, "ppo/actor/clip": 0.25}
    assert t.reduce() == {}  # reduce empties the tracker
    t.add_scalar("x", 5)
    assert t.reduce(None) == {"x": 5.0}


def test_tracker_reduces_sum_and_max_stats_without_dp():
    ps = SimpleNamespace(is_last_stage=True, dp=1, pp=1, device=torch.device("cpu"))
    t = StatsTracker()
    t.add_stats({"a": Stat(torch.tensor(3.0), torch.tensor(2.0)),
                 "m": Stat.masked_max(torch.tensor([1.0, 5.0]), torch.tensor([1.0, 0.0]))})
    t.add_stats({"a": Stat(torch.tensor(1.0), torch.tensor(2.0)),
                 "m": Stat.masked_max(torch.tensor([2.0]), torch.tensor([1.0]))})
    assert t.reduce(ps) == {"a": 1.0, "m": 2.0}
    assert t.stats == {}


def _ps(rank, dp, pp):
    """Both processes in one DP group (dp=2) or one pipeline (pp=2; rank 1 is the last stage)."""
    world = dist.group.WORLD
    return ParallelState(rank=rank, world_size=2, tp=1, pp=pp, dp=dp, tp_rank=0,
                         pp_rank=rank if pp > 1 else 0, dp_rank=rank if dp > 1 else 0,
                         dp_group=world if dp > 1 else None, pp_group=world if pp > 1 else None,
                         pp_global_ranks=[0, 1] if pp > 1 else [rank])


def _reduce_worker(rank, store, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    calls = []
    orig = dist.all_reduce
    dist.all_reduce = lambda *a, **k: (calls.append(a[0].numel()), orig(*a, **k))[1]
    t = StatsTracker()
    if rank == 0:
        t.add("loss", 6.0, 3)
        t.add_scalar("grad_norm", 1.0)
        t.add_masked("adv", torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 1, 0]))
        t.add("empty", 0.0, 0)
    else:  # same names, other order and counts
        t.add("empty", 0.0, 0)
        t.add("adv", 0.0, 0)
        t.add("loss", 2.0, 1)
        t.add("loss", 4.0, 4)
        t.add_scalar("grad_norm", 3.0)
    result = t.reduce(_ps(rank, dp=2, pp=1))
    sum_calls = list(calls)
    # SUM and MAX kinds: one packed all_reduce each
    t.add_stats({"gap": Stat.masked_mean(torch.tensor([1.0, 3.0]) * (rank + 1), torch.ones(2)),
                 "gap_max": Stat.masked_max(torch.tensor([1.0, 3.0]) * (rank + 1), torch.ones(2))})
    both = t.reduce(_ps(rank, dp=2, pp=1))
    both_calls = calls[len(sum_calls):]
    # PP=2: only the last stage (rank 1) ran loss functions; every stage gets its dict
    if rank == 1:
        t.add("loss", 3.0, 2)
    piped = t.reduce(_ps(rank, dp=1, pp=2))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"result": result, "all_reduce_numels": sum_calls, "both": both,
                   "both_numels": both_calls, "piped": piped}, f)
    dist.destroy_process_group()


def test_tracker_reduces_over_dp_with_one_all_reduce_per_kind(tmp_path):
    mp.spawn(_reduce_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # loss (6+2+4)/(3+1+4); grad_norm (1+3)/2; adv 3/2 (rank 1 adds 0 tokens); empty 0.0
        assert got["result"] == {"adv": 1.5, "empty": 0.0, "grad_norm": 2.0, "loss": 1.5}
        assert got["all_reduce_numels"] == [8]  # one call: 4 sums + 4 counts
        # gap (1+3+2+6)/4; gap_max max(3, 6); one SUM call (1 sum + 2 counts), one MAX call
        assert got["both"] == {"gap": 3.0, "gap_max": 6.0}
        assert got["both_numels"] == [3, 1]
        assert got["piped"] == {"loss": 1.5}


def test_logger_jsonl_console_and_rank(tmp_path, capsys):
    with MetricsLogger(str(tmp_path / "run"), tensorboard=False, console_keys=["loss", "reward"]) as log:
        log.log({"loss": torch.tensor(0.5), "reward": 0.123456, "lr": 1e-5}, step=1)
        log.log({"loss": 0.25, "lr": float("nan")}, step=2)
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 0.5), (2, 0.25)]
    assert rows[0]["reward"] == 0.123456 and rows[0]["lr"] == 1e-5 and rows[1]["lr"] == "nan"
    assert capsys.readouterr().out.splitlines() == ["step 1 | loss 0.5 | reward 0.1235", "step 2 | loss 0.25"]
    off = MetricsLogger(str(tmp_path / "off"), enabled=False)
    off.log({"loss": 1.0}, step=1)
    assert not (tmp_path / "off").exists()


def test_logger_without_tensorboard_package_still_logs(tmp_path, capsys):
    log = MetricsLogger(str(tmp_path), tensorboard=True, console=False)
    log.log({"a": 1.0}, step=0)
    log.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["a"] == 1.0
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        assert "[metrics] tensorboard logging off" in capsys.readouterr().err


def test_print0_and_progress(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    print0("hidden")
    assert list(progress(3, desc="x")) == [0, 1, 2]
    assert capsys.readouterr() == ("", "")
    monkeypatch.setenv("RANK", "0")
    print0("shown", 1)
    assert list(progress(["a", "b"], desc="work")) == ["a", "b"]
    out, err = capsys.readouterr()
    assert out == "shown 1\n"
    assert err.startswith("work [####################] 2/2 00:00<00:00") and err.endswith("it/s\n")


def test_plot_metrics_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps({"step": s, "time": 0, "loss": 1 / (s + 1), "reward": s / 10}) + "\n"
                            for s in range(20)))
    out = tmp_path / "plot.png"
    tool = os.path.join(REPO, "tools", "plot_metrics.py")
    r = subprocess.run([sys.executable, tool, str(path), "--keys", "loss,reward", "--out", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    r = subprocess.run([sys.executable, tool, str(path), "--keys", "nope", "--out", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "metric(s) ['nope'] not found; available: ['loss', 'reward']" in r.stderr
