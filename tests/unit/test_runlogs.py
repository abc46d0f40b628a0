"""megarl.common.runlogs: every per-step log of a run dir cut back to its recorded size, in place."""
import os

from megarl.common import runlogs


def _write(path, text, mode="w"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, mode) as f:
        f.write(text)


def test_sizes_then_rollback_cuts_each_log_to_its_recorded_size(tmp_path):
    run = str(tmp_path)
    _write(f"{run}/metrics.jsonl", '{"step": 1}\n')
    _write(f"{run}/generations.jsonl", '{"step": 1, "completion": "a"}\n')
    _write(f"{run}/timeline/rank0.jsonl", '{"name": "push"}\n')
    _write(f"{run}/config.yaml", "not a per-step log\n")
    saved = runlogs.sizes(run)
    assert saved == {"generations.jsonl": 31, "metrics.jsonl": 12, "timeline/rank0.jsonl": 17}
    held = open(f"{run}/metrics.jsonl", "a")  # the metrics logger keeps its file open
    held.write('{"step": 2}\n')
    held.flush()
    _write(f"{run}/generations.jsonl", '{"step": 2, "completion": "b"}\n', "a")
    _write(f"{run}/failed_prompts.jsonl", '{"prompt_index": 4}\n')  # not there at the save
    _write(f"{run}/timeline/rank0.jsonl", '{"name": "gen"}\n{"name": "to', "a")  # torn
    cut = runlogs.rollback(run, saved)
    assert cut == ["failed_prompts.jsonl: 20 bytes dropped", "generations.jsonl: 31 bytes dropped",
                   "metrics.jsonl: 12 bytes dropped", "timeline/rank0.jsonl: 28 bytes dropped"]
    assert open(f"{run}/metrics.jsonl").read() == '{"step": 1}\n'
    assert open(f"{run}/failed_prompts.jsonl").read() == ""
    held.write('{"step": 2, "again": true}\n')  # lands right after the cut (append mode)
    held.close()
    assert open(f"{run}/metrics.jsonl").read() == '{"step": 1}\n{"step": 2, "again": true}\n'
    assert open(f"{run}/config.yaml").read() == "not a per-step log\n"
    assert runlogs.rollback(run, runlogs.sizes(run)) == []


def test_a_cut_inside_a_line_moves_to_its_start(tmp_path):
    run = str(tmp_path)
    _write(f"{run}/generations.jsonl", '{"step": 1}\n{"step": 2}\n')
    assert runlogs.rollback(run, {"generations.jsonl": 18}) == ["generations.jsonl: 12 bytes dropped"]
    assert open(f"{run}/generations.jsonl").read() == '{"step": 1}\n'


def test_no_record_leaves_the_logs_alone(tmp_path):
    _write(f"{tmp_path}/generations.jsonl", '{"step": 9}\n')
    assert runlogs.rollback(str(tmp_path), None) == []
    assert os.path.getsize(f"{tmp_path}/generations.jsonl") == 12
