"""A checkpoint save on a full disk (issue 40): a real demo run whose checkpoint.save_dir is a
12 MiB tmpfs, room for one checkpoint of the demo (~7.3 MiB) but not two. The second save fails;
the run ends with one line saying the disk is full (path, MiB needed, MiB free), exit 1, no
traceback; the partial directory is gone, ``latest`` still names step 1, and once there is
room the same command resumes from it and finishes."""
from __future__ import annotations

import os
import subprocess

import harness
import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_is_one_line_and_the_previous_checkpoint_resumes(tmp_path, small_disk):
    save_dir = small_disk / "ckpt"
    args = ("train.steps=3", "checkpoint.save_interval=1", f"checkpoint.save_dir={save_dir}",
            "checkpoint.keep_last=1", "train.global_batch_size=32", "rollout.eval_at_start=false")
    run = harness.train(tmp_path / "run", *args)
    assert run.returncode == 1, run.log[-3000:]
    line = run.last_line
    assert line.startswith(f"megarl-train: CheckpointError: checkpoint.save_dir: no space left on {save_dir} "
                           "to write step_00000002: it needs ~"), line
    assert "MiB free; the previous checkpoint" in line and "step_00000001 is intact and stays latest (" in line
    assert "Traceback" not in run.stderr and "inline_container" not in run.stderr
    assert sorted(os.listdir(save_dir)) == ["latest", "step_00000001"]  # no partial directory left
    assert (save_dir / "latest").read_text().strip() == "step_00000001"
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    again = harness.train(tmp_path / "run", *args).check()
    assert [r["step"] for r in again.rows][-2:] == [2, 3]  # resumed after step 1
    assert (save_dir / "latest").read_text().strip() == "step_00000003"
