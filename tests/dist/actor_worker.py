"""torchrun worker: the PPO actor (and the GAE critic) under several TP/PP/DP layouts and
micro-batch budgets. Rank 0 writes {layout: results} as JSON for test_actor.py.

Layout specs: "actor,tp,pp,micro_batch_tokens,ppo_mini_batch_size" (prox_logp_mode=metrics),
"loglinear,..." (the same with prox_logp_mode=loglinear) and "critic,tp,pp,mbt".
Every layout sees the same step: 8 sequences in 4 groups of 2, whole groups per DP rank (the
rollout manager's layout: group g on DP rank g % dp), behave_logp = the trainer's own
logprob + fixed noise (so behaviour weights are not 1 and some are capped), versions v-1 / v.
"""
import json
import random
import sys
import time

import torch
import torch.distributed as dist

from megarl.common import compat
from megarl.trainer import parallel
from megarl.config import load_config
from megarl.trainer.actor import Actor, step_advantages
from megarl.trainer.batch import TensorBatch, pad_sequences, per_sample
from megarl.trainer.critic import Critic, CriticSpec

VERSION = 3
ALGO = ["algo.policy_loss=decoupled_ppo", "algo.prox_logp_mode=metrics",
        "algo.loss_agg=seq_mean_token_mean", "algo.kl_coef=0.05", "algo.entropy_coef=0.01",
        "algo.behave_weight_cap=1.15", "algo.eps_clip_low=0.1", "algo.eps_clip_high=0.1"]


def make_step(n=8, vocab=128, seed=0):
    rng = random.Random(seed)
    ids, mask, noise, versions = [], [], [], []
    for _ in range(n):
        length = rng.randint(6, 20)
        prompt = rng.randint(2, length - 2)
        ids.append([rng.randrange(vocab) for _ in range(length)])
        mask.append([0.0] * prompt + [1.0] * (length - prompt))
        noise.append([0.0] * prompt + [rng.gauss(0.0, 0.1) for _ in range(length - prompt)])
        old = rng.random() < 0.5  # half the samples come from the previous policy version
        versions.append([-1.0] * prompt + [float(VERSION - old)] * (length - prompt))
    rewards = [float(rng.random() < 0.5) + 0.1 * i for i in range(n)]
    return ids, mask, noise, versions, rewards, [i // 2 for i in range(n)]


def gather_rows(mine, rows_by_name, n):
    """{name: per-sample list over the whole step} from every rank's local rows."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {name: dict(zip(mine, rows))
                                   for name, rows in rows_by_name.items()})
    out = {}
    for name in rows_by_name:
        merged = {}
        for p in parts:
            merged.update(p[name])
        out[name] = [merged[i] for i in range(n)]
    return out


def config(hf_dir, tp, pp, mbt, mini, extra=()):
    return load_config(None, [f"model.hf_path={hf_dir}", "data.train_path=x", f"parallel.tp={tp}",
                              f"parallel.pp={pp}", f"train.micro_batch_tokens={mbt}",
                              f"train.ppo_mini_batch_size={mini}", "train.ppo_epochs=2",
                              # Adam's first step moves a coordinate by lr * g / (|g| + eps):
                              # with the default eps=1e-8, float noise in a gradient coordinate
                              # of ~1e-8 shifts it by ~lr / 10 between layouts; 1e-6 damps that.
                              "optim.lr=0.002", "optim.adam_eps=1e-6", *ALGO, *extra])


def run_actor(hf_dir, tp, pp, mbt, mini, step, extra=()):
    ids, mask, noise, versions, rewards, gids = step
    cfg = config(hf_dir, tp, pp, mbt, mini, extra)
    ps = parallel.init_model_parallel(tp, pp, seed=1234)
    actor = Actor.build(cfg, ps)
    mine = [i for i in range(len(ids)) if gids[i] % ps.dp == ps.dp_rank]  # whole groups per rank
    step_batch = TensorBatch.from_lists(ids, {"loss_mask": mask, "versions": versions},
                                        {"rewards": rewards, "group_ids": gids})
    local = step_batch.select(mine)
    true = actor.engine.compute_logp(local).logp
    # in float64, rounded once to the float32 field (as the per-sample lists used to be)
    noise64 = pad_sequences([noise[i] for i in mine], torch.float64)
    behave = ((true.double() + noise64) * local["loss_mask"].double()).float()
    full_adv = step_advantages(actor.spec.advantage, step_batch).advantages
    local = local.with_fields(behave_logp=behave)
    # each rank's share of whole groups gives its rows of the whole-step advantages
    local, stats = actor.step_fields(local, VERSION)
    adv_ok = torch.equal(local["advantages"], full_adv[mine, :local.seq_len])
    metrics = actor.ppo_update(local, version=VERSION, stats=stats)
    after = actor.engine.compute_logp(local).logp
    rows = gather_rows(mine, {"before": [t.tolist() for t in per_sample(true, local.lengths)],
                              "after": [t.tolist() for t in per_sample(after, local.lengths)]},
                       len(ids))
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, adv_ok)
    parallel.destroy_model_parallel_only()
    return {"logp": rows["before"], "logp_after": rows["after"], "metrics": metrics,
            "adv_ok": all(flags), "updates": actor.updates}


def run_critic(hf_dir, tp, pp, mbt, step):
    ids, mask, _, _, rewards, gids = step
    cfg = config(hf_dir, tp, pp, mbt, 0, ["algo.advantage=gae", "algo.lam=0.95",
                                          "critic.lr=0.01", "critic.value_clip=0.5"])
    ps = parallel.init_model_parallel(tp, pp, seed=1234)
    critic = Critic.build(CriticSpec.from_config(cfg), ps)
    mine = [i for i in range(len(ids)) if gids[i] % ps.dp == ps.dp_rank]
    local = TensorBatch.from_lists(ids, {"loss_mask": mask},
                                   {"rewards": rewards, "group_ids": gids}).select(mine)
    # GAE on this rank's values, whitened over the step (no engine needed for advantages)
    local, _ = Actor(cfg, ps, engine=None).step_fields(local, 0, values=critic.values(local), update=False)
    m1 = critic.update(local)
    mid = critic.values(local)
    m2 = critic.update(local.with_fields(values=mid))
    rows = gather_rows(mine, {k: [t.tolist() for t in per_sample(v, local.lengths)]
                              for k, v in (("values", local["values"]), ("values_after", mid),
                                           ("advantages", local["advantages"]))}, len(ids))
    parallel.destroy_model_parallel_only()
    return {**rows, "metrics": m1, "metrics2": m2}


def main():
    hf_dir, out, *layouts = sys.argv[1:]
    compat.quiet_megatron_warnings()
    torch.set_num_threads(1)
    parallel.init_distributed()
    step = make_step()
    results = {}
    for spec in layouts:
        t0 = time.perf_counter()
        kind, *nums = spec.split(",")
        nums = [int(x) for x in nums]
        if kind == "actor":
            results[spec] = run_actor(hf_dir, *nums, step)
        elif kind == "loglinear":
            results[spec] = run_actor(hf_dir, *nums, step, ["algo.prox_logp_mode=loglinear"])
        else:
            results[spec] = run_critic(hf_dir, *nums, step)
        results[spec]["wall_s"] = time.perf_counter() - t0
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
