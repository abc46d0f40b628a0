"""Bad-input corpus, class "waits with no end or no word": preflight's wait for a rollout server
that never answers prints progress while it waits and ends at its deadline (rollout.health_timeout_s,
at most `megarl.rollout.probe.HEALTH_WAIT_CAP_S` whatever the config says) with one line naming the server."""
from __future__ import annotations

import re
import time

import pytest
from badinput_support import REPO, TINY, CliCase, check_cli_result, closed_port, docs_missing, run_cli

CASE = CliCase("server_dead_progress", "megarl-train",
               (f"{REPO}/configs/tiny_grpo.yaml", f"model.hf_path={TINY}/model", "data.eval_path=",
                f"data.train_path={TINY}/data/rl_prompts.jsonl", "train.run_dir={root}/runs/x",
                "rollout.servers=[{refused}]", "rollout.health_timeout_s=12"), 2,
               ("rollout.servers[0]: http://127.0.0.1:", "did not answer /health within "
                "rollout.health_timeout_s=12 s", "Connection refused"), ("{root}/runs/x",))
CASES = {f"megarl-train:{CASE.id}": CASE}


def test_a_dead_server_is_waited_for_with_progress(tmp_path):
    paths = {"root": str(tmp_path), "refused": f"http://127.0.0.1:{closed_port()}"}
    fill = lambda text: text.format(**paths)  # noqa: E731
    res = run_cli("megarl-train", [fill(a) for a in CASE.args], str(tmp_path), timeout=120)
    check_cli_result(CASE, res, fill)
    waits = re.findall(r"\[megarl\] preflight: waiting for rollout\.servers\[0\] \S+/health: (\d+) s of 12 s "
                       r"\(URLError: \[Errno 111\] Connection refused\)", res.stdout)
    assert [int(w) for w in waits] == [5, 10], res.stdout[-2000:]


def test_a_huge_timeout_is_capped(monkeypatch, capsys):
    from megarl.launch import preflight
    from megarl.config import ConfigError
    from megarl.rollout import probe

    monkeypatch.setattr(probe, "HEALTH_WAIT_CAP_S", 2.0)
    monkeypatch.setattr(probe, "PROGRESS_FIRST_S", 1.0)
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        preflight.check_servers([f"127.0.0.1:{closed_port()}"], None, 1e9)
    assert time.monotonic() - t0 < 4
    assert "did not answer /health within 2 s (rollout.health_timeout_s=1e+09, capped at 2 s)" in str(e.value)
    assert "preflight: waiting for rollout.servers[0]" in capsys.readouterr().out


def test_docs_list_every_case():
    assert not docs_missing(CASES), docs_missing(CASES)
