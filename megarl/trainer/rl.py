"""The asynchronous RL loop (GRPO family) on all trainer ranks.

    rank 0: controller thread generates groups ahead (bounded by the staleness window)
    every step, all ranks:
        groups   <- controller.next_batch()              (rank 0; broadcast to all ranks)
        share    <- token-balanced DP split
        share    <- actor.with_advantages(share, ...)    (step-level group baselines)
        metrics  <- actor.ppo_update(share)              (prox recompute, PPO epochs, mini-batches)
        every train.trigger_parameter_sync_step steps: pusher.push(): pause rollouts -> push
        weights -> cluster.version + 1 -> resume (in-flight samples continue as partial
        rollouts, or finished under the old weights first without rollout.partial_rollout)
        every rollout.eval_interval steps (and at step 0 with rollout.eval_at_start): greedy
        held-out accuracy (blocking); train.stop_at_eval_accuracy ends the run when it is reached
    at the end, train.py writes run_dir/learning_curve.png (megarl/plotting.py)

The four modes of seed 003 are config alone (docs/async.md):
    on-policy           max_staleness 0, trigger 1
    stream off-policy   max_staleness 0, trigger k       (k steps per push, one version)
    async, stale        max_staleness > 0 or staleness_threshold > 0, partial_rollout false
    async, partial      the same with partial_rollout true (the default)

The `RolloutCluster` (every rank) owns the policy version; the controller (rank 0) subscribes to
it, so a push pauses and resumes generation exactly once.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Optional

import torch.distributed as dist

from megarl.checkpoint import maybe_export_hf
from megarl.data.datasets import PromptDataset, balance_across_ranks
from megarl.data.tokenizer import load_tokenizer
from megarl.metrics import print0, progress
from megarl.rollout.cluster import RolloutCluster
from megarl.rollout.controller import RolloutController
from megarl.rollout.local import LocalCluster, split_cpus
from megarl.rollout.rewards import load_reward_fn
from megarl.rollout.types import SamplingParams, Trajectory
from megarl.rollout.workflow import load_workflow_class
from megarl.timeline import Timeline
from megarl.trainer.actor import Actor
from megarl.trainer.batch import SequenceBatch
from megarl.trainer.rollout_stats import StepTimer, batch_metrics, dump_generations
from megarl.weights.push import WeightPusher


def _broadcast(obj, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def groups_per_step(cfg) -> int:
    return cfg.train.step_batch_size // cfg.rollout.group_size


def build_controller(cfg, cluster: RolloutCluster, timeline=None) -> RolloutController:
    r = cfg.rollout
    tok = load_tokenizer(cfg.data.tokenizer_path or cfg.model.hf_path)
    dataset = PromptDataset(cfg.data.train_path, tok, prompt_key=cfg.data.prompt_key)
    sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              stop_token_ids=None if r.ignore_eos else [tok.eos_id],  # a stop id stops even with ignore_eos
                              ignore_eos=r.ignore_eos)
    workflow = load_workflow_class(r.workflow)(tok, load_reward_fn(r.reward_fn), sampling, r.group_size,
                                               **r.workflow_kwargs)
    # the staleness clock ticks once per push, which covers trigger_parameter_sync_step steps
    per_version = groups_per_step(cfg) * cfg.train.trigger_parameter_sync_step
    return RolloutController(
        dataset, workflow, cluster.addresses, cluster, batch_groups=per_version,
        max_staleness=r.staleness, max_concurrent=r.max_concurrent, seed=cfg.train.seed,
        api_key=r.api_key or None, dynamic_sampling=cfg.algo.dynamic_sampling,
        partial_rollout=r.partial_rollout, max_retries=r.max_retries,
        failed_log=os.path.join(cfg.train.run_dir, "failed_prompts.jsonl"), timeline=timeline)


def local_share(trajs: list[Trajectory], ps) -> tuple[SequenceBatch, list[float], list[int]]:
    mine = balance_across_ranks([len(t.input_ids) for t in trajs], ps.dp)[ps.dp_rank]
    sel = [trajs[i] for i in mine]
    batch = SequenceBatch([t.input_ids for t in sel], {
        "loss_mask": [[float(m) for m in t.loss_mask] for t in sel],
        "behave_logp": [t.behave_logp for t in sel],
        "versions": [[float(v) for v in t.versions] for t in sel]})
    return batch, [t.reward for t in sel], [t.group_id for t in sel]


def evaluate(cfg, servers: list[str]) -> Optional[float]:
    """Greedy exact-answer accuracy on the first ``rollout.eval_size`` eval prompts (rank 0).

    Runs on this thread's own event loop and client, beside the controller's."""
    if not cfg.data.eval_path:
        return None
    import asyncio

    from megarl.rollout.client import RolloutClient
    from megarl.rollout.evaluation import evaluate_samples
    from megarl.rollout.rewards import arith_exact_match

    tok = load_tokenizer(cfg.data.tokenizer_path or cfg.model.hf_path)
    samples = PromptDataset(cfg.data.eval_path, tok).samples[:cfg.rollout.eval_size]
    sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0,
                              stop_token_ids=[tok.eos_id])

    async def run():
        async with RolloutClient(servers, cfg.rollout.api_key or None) as client:
            return await evaluate_samples(client, samples, arith_exact_match, sampling, tok)

    return asyncio.run(run()).accuracy


def run_rl(cfg, ps, engine, logger, ckpt) -> None:
    r, t = cfg.rollout, cfg.train
    with contextlib.ExitStack() as stack:
        servers = list(r.servers)
        if not servers and ps.rank == 0:
            server_cpus, trainer_cpus = split_cpus(r.server_cpus) if r.server_cpus else (None, None)
            servers = stack.enter_context(LocalCluster(
                cfg.model.hf_path, r.local_servers, f"{t.run_dir}/servers",
                extra=["--threads", r.server_threads], cpus=server_cpus))
            if trainer_cpus:  # generation and training on their own cores (docs/demo.md)
                os.sched_setaffinity(0, trainer_cpus)
        cluster = RolloutCluster.from_config(cfg, _broadcast(servers), driver=ps.rank == 0)
        stack.callback(cluster.close)
        timeline = Timeline(f"{t.run_dir}/timeline/rank{ps.rank}.jsonl" if cfg.logging.timeline and
                            ps.rank == 0 else None)
        stack.callback(timeline.close)
        actor = Actor.build(cfg, ps, engine)
        pusher = WeightPusher(cfg, engine, cluster)
        stack.callback(pusher.close)
        controller = build_controller(cfg, cluster, timeline) if ps.rank == 0 else None
        if controller is not None:
            ckpt.register("controller", controller)
        start = ckpt.resume()
        cluster.version = ckpt.policy_version  # the checkpoint records the version it was saved at
        actor.updates = start  # one PPO update per step: the mini-batch shuffle continues where it was
        pusher.push(bump=False)  # servers hold exactly the trainer's weights before any rollout
        if r.eval_at_start and start == 0:  # the learning curve's start point, before any rollout
            t0 = time.perf_counter()
            acc = evaluate(cfg, cluster.addresses) if ps.rank == 0 else None
            if acc is not None:
                logger.log({"eval_accuracy": acc, "time/eval": time.perf_counter() - t0,
                            "policy_version": cluster.version}, 0)
        if controller is not None:
            cluster.subscribe(controller)  # after the first push: nothing to pause before
            controller.start()
            stack.callback(controller.stop)
        timer = StepTimer(timeline)
        step = start
        for step in progress(range(start + 1, t.steps + 1), desc="grpo", total=t.steps - start):
            last = step == t.steps
            with timer.phase("wait"):
                trajs = _broadcast(controller.next_batch(groups_per_step(cfg)) if controller else None)
            batch, rewards, group_ids = local_share(trajs, ps)
            with timer.phase("update"):
                batch = actor.with_advantages(batch, rewards, group_ids)
                metrics = actor.ppo_update(batch, version=cluster.version)
            metrics.update(batch_metrics(trajs, cluster.version))
            if cfg.logging.dump_generations and ps.rank == 0:
                dump_generations(f"{t.run_dir}/generations.jsonl", step, cluster.version, trajs)
            if step % t.trigger_parameter_sync_step == 0 or last:
                with timer.phase("push"):
                    metrics.update(pusher.push().as_dict())
            metrics["policy_version"] = cluster.version
            stop = False
            if r.eval_interval and step % r.eval_interval == 0 or last:
                with timer.phase("eval"):
                    acc = evaluate(cfg, cluster.addresses) if ps.rank == 0 else None
                if acc is not None:
                    metrics["eval_accuracy"] = acc
                if t.stop_at_eval_accuracy and not last:  # rank 0 decides for every rank
                    stop = _broadcast(acc is not None and acc >= t.stop_at_eval_accuracy)
            if controller is not None:
                metrics.update(controller.stats())
            metrics.update(timer.finish(
                metrics, controller.client.busy_seconds() if controller else None,
                controller.client.stats["tokens"] if controller else None,
                trained_tokens=sum(len(x.input_ids) for x in trajs)))
            logger.log(metrics, step)
            ckpt.maybe_save(step, last=last or stop, policy_version=cluster.version)
            maybe_export_hf(cfg, engine, step, last=last or stop)
            if stop:
                print0(f"[grpo] eval accuracy reached train.stop_at_eval_accuracy="
                       f"{t.stop_at_eval_accuracy} at step {step}")
                break
        print0(f"[grpo] done: {step} steps, policy version {cluster.version}")
