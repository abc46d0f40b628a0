"""On-policy distillation (algo.distill_coef, teacher.*): the advantage formula by hand, the
teacher's logprobs through the step's arrays to a trainer rank's batch, the teacher client's
alignment of a scored sample, and the config's refusals."""
import asyncio
import os

import numpy as np
import pytest
import torch

from megarl.common.errors import ConfigError
from megarl.config.load import load_config
from megarl.protocol.packing import pack_batch
from megarl.protocol.types import Trajectory
from megarl.rollout.teacher import TeacherClient, TeacherError
from megarl.trainer.actor import distill_advantages
from megarl.trainer.batch import TensorBatch
from megarl.trainer.handoff import ReceivedStep
from megarl.trainer.metrics import StatsTracker

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(REPO, "configs", "tiny_grpo.yaml")
TINY = os.path.join(REPO, "examples", "tiny", "model")


def traj(ids, mask, behave, teacher, gid=0):
    return Trajectory(ids, mask, behave, [-1 if not m else 0 for m in mask], 1.0, gid, teacher_logp=teacher)


def test_the_advantage_is_the_weighted_task_advantage_plus_the_teachers_signal():
    batch = TensorBatch.from_lists([[1, 2, 3, 4], [1, 5, 6]], {
        "loss_mask": [[0, 1, 1, 1], [0, 1, 1]], "behave_logp": [[0, -1.0, -2.0, -0.5], [0, -0.25, -3.0]],
        "teacher_logp": [[0, -0.5, -2.5, -0.5], [0, -1.25, -1.0]]})
    task = torch.tensor([[0.0, 2.0, 2.0, 2.0], [0.0, -1.0, -1.0, 0.0]], dtype=torch.float64)
    acc = StatsTracker()
    got = distill_advantages(task, batch, coef=0.5, reward_coef=0.25, acc=acc)
    want = torch.tensor([[0.0, 0.25 * 2 + 0.5 * 0.5, 0.25 * 2 - 0.5 * 0.5, 0.5],
                         [0.0, -0.25 - 0.5 * 1.0, -0.25 + 0.5 * 2.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(got, want, atol=1e-7)
    stats = acc.reduce()
    # reverse KL estimate: mean over the 5 generated tokens of behave - teacher
    assert stats["distill/reverse_kl"] == pytest.approx((-0.5 + 0.5 + 0.0 + 1.0 - 2.0) / 5)
    assert stats["distill/teacher_logp"] == pytest.approx((-0.5 - 2.5 - 0.5 - 1.25 - 1.0) / 5)
    with pytest.raises(ValueError, match="no teacher_logp"):
        distill_advantages(task, TensorBatch.from_lists([[1, 2]], {"loss_mask": [[0, 1]], "behave_logp": [[0, -1.0]]}),
                           1.0, 1.0)


def test_teacher_logprobs_travel_with_the_step_to_each_rank():
    trajs = [traj([1, 2, 3], [0, 1, 1], [0, -1.0, -2.0], [0, -1.5, -2.5], gid=0),
             traj([1, 4, 5, 6], [0, 1, 1, 1], [0, -1.0, -1.0, -1.0], [0, -0.1, -0.2, -0.3], gid=1)]
    b = pack_batch(trajs, dp=2, stats={}, rejoin=[])
    assert b.arrays["teacher_logp"].dtype == np.float64 and len(b.arrays["teacher_logp"]) == 7
    step = ReceivedStep(b.arrays, b.infos)
    shares = [step.share(r) for r in (0, 1)]
    got = sorted(s["teacher_logp"][0, :s.lengths[0]].tolist() for s in shares)  # float32 on the trainer
    assert got == sorted([np.float32([0.0, -1.5, -2.5]).tolist(), np.float32([0.0, -0.1, -0.2, -0.3]).tolist()])
    no_teacher = pack_batch([Trajectory([1, 2], [0, 1], [0, -1.0], [-1, 0], 1.0, 0)], 1, {}, [])
    assert "teacher_logp" not in no_teacher.arrays and "teacher_logp" not in ReceivedStep(no_teacher.arrays).share(0)


def test_a_scored_sample_is_aligned_token_by_token():
    t = traj([7, 8, 9, 10, 11], [0, 0, 1, 0, 1], [0, 0, -1.0, 0, -1.0], None)  # a tool turn between
    res = {"meta_info": {"input_token_logprobs": [[-0.5, 9, None], [-0.7, 10, None], [-0.9, 11, None]]}}
    assert TeacherClient._aligned(t, res, 2) == [0.0, 0.0, -0.5, 0.0, -0.9]
    with pytest.raises(TeacherError, match="position 4 scored token 12 as -0.9, the sample has 11"):
        TeacherClient._aligned(t, {"meta_info": {"input_token_logprobs": [[-0.5, 9, None], [-0.7, 10, None],
                                                                          [-0.9, 12, None]]}}, 2)
    with pytest.raises(TeacherError, match="2 prompt logprobs for positions 2..4"):
        TeacherClient._aligned(t, {"meta_info": {"input_token_logprobs": [[-0.5, 9, None]] * 2}}, 2)
    empty = traj([7, 8], [0, 0], [0, 0], None)
    asyncio.run(TeacherClient(["http://127.0.0.1:9"]).score([empty]))  # nothing generated: no request
    assert empty.teacher_logp == [0.0, 0.0]


def test_config_refusals():
    cases = {"algo.distill_coef: on-policy distillation needs both a teacher": ["algo.distill_coef=1"],
             "algo.distill_coef: on-policy distillation needs both": [f"teacher.path={TINY}"],
             "teacher.path: on-policy distillation is RL": [f"teacher.path={TINY}", "algo.distill_coef=1",
                                                           "train.algorithm=sft"],
             "teacher.path: the teacher servers are started by the job": [
                 f"teacher.path={TINY}", "algo.distill_coef=1", "rollout.servers=[http://127.0.0.1:9]"]}
    for message, overrides in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(RECIPE, overrides)
    cfg = load_config(RECIPE, [f"teacher.path={TINY}", "algo.distill_coef=0.5", "algo.distill_reward_coef=0"])
    spec = cfg.algo.build()
    assert (spec.distill_coef, spec.distill_reward_coef) == (0.5, 0.0)
