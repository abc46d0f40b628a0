"""On-policy distillation end to end: megarl-train with a teacher the job serves (teacher.path,
megarl-server on a causal LM) scoring every generated token. With the student's own start model
as the teacher and on-policy generation, the first step's teacher logprobs are the sampler's own
(the whole path - request, positions, the step's arrays, the advantage - is aligned token by
token); once the student has moved, the reverse KL it reports is positive."""
import harness

TEACHER = harness.TINY / "model"


def test_a_teacher_equal_to_the_start_model_scores_each_token_as_the_sampler_did(tmp_path):
    run = tmp_path / "run"
    done = harness.train(run, "train.steps=3", "train.global_batch_size=64", "rollout.max_staleness=0",
                         f"teacher.path={TEACHER}", "algo.distill_coef=1.0", "optim.lr=1e-3",
                         "optim.lr_warmup_steps=0", check=True)
    rows = done.rows
    print("\n[distill] " + "; ".join(f"step {r['step']}: reverse KL {r['distill/reverse_kl']:.3g}, teacher logp "
                                     f"{r['distill/teacher_logp']:.3g}" for r in rows))
    assert [r["step"] for r in rows] == [1, 2, 3]
    # step 1: the student's weights are the teacher's, so its logprob of every sampled token is the
    # teacher's (two fp32 forwards of one model); a token misplaced by one position would be ~1 nat off
    assert abs(rows[0]["distill/reverse_kl"]) < 1e-5 and rows[0]["distill/teacher_logp"] < -0.01
    # after two updates at lr 1e-3 the student samples what it now prefers more than the teacher does
    assert rows[-1]["distill/reverse_kl"] > 1e-3
    assert rows[-1]["teacher/requests"] >= 3 * 64 // 8 and rows[-1]["teacher/tokens"] > 0  # one request per group
    assert (run / "teacher_servers").is_dir()
