"""metrics.jsonl stays one row per step, in order, across restarts and hard kills."""
import json

from megarl.trainer.metrics import MetricsLogger


def steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resume_from_an_older_checkpoint_replaces_the_rows_after_it(tmp_path):
    with MetricsLogger(str(tmp_path), tensorboard=False, console=False, enabled=True) as log:
        for s in range(1, 6):
            log.log({"loss": float(s)}, s)
    with MetricsLogger(str(tmp_path), tensorboard=False, console=False, enabled=True) as log:
        log.log({"loss": 40.0}, 4)  # resumed from the step-3 checkpoint
        log.log({"loss": 50.0}, 5)
        log.log({"loss": 60.0}, 6)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows] == [1.0, 2.0, 3.0, 40.0, 50.0, 60.0]


def test_clean_resume_appends_and_a_torn_line_is_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLogger(str(tmp_path), tensorboard=False, console=False, enabled=True) as log:
        log.log({"loss": 1.0}, 1)
        log.log({"loss": 2.0}, 2)
    with open(path, "a") as f:
        f.write('{"step": 3, "lo')  # killed mid-write
    with MetricsLogger(str(tmp_path), tensorboard=False, console=False, enabled=True) as log:
        log.log({"loss": 3.0}, 3)
    assert steps(path) == [1, 2, 3]
