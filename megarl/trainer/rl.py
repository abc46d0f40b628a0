"""The asynchronous RL loop (GRPO family) on all trainer ranks.

    rank 0: controller thread generates groups ahead (bounded by rollout.max_staleness)
    every step, all ranks:
        groups   <- controller.next_batch()              (rank 0; broadcast to all ranks)
        share    <- token-balanced DP split
        share    <- actor.with_advantages(share, ...)    (step-level group baselines)
        metrics  <- actor.ppo_update(share)              (prox recompute, PPO epochs, mini-batches)
        pusher.push(): pause rollouts -> push weights -> cluster.version + 1 -> resume; in-flight
        samples continue as partial rollouts under the new version

The `RolloutCluster` (every rank) owns the policy version; the controller (rank 0) subscribes to
it, so the push pauses and resumes generation exactly once.
"""
from __future__ import annotations

import contextlib
import statistics
from typing import Optional

import torch.distributed as dist

from megarl.checkpoint import maybe_export_hf
from megarl.data.datasets import PromptDataset, balance_across_ranks
from megarl.data.tokenizer import load_tokenizer
from megarl.metrics import print0, progress
from megarl.rollout.cluster import RolloutCluster
from megarl.rollout.controller import RolloutController
from megarl.rollout.local import LocalCluster
from megarl.rollout.rewards import load_reward_fn
from megarl.rollout.types import SamplingParams, Trajectory
from megarl.rollout.workflow import load_workflow_class
from megarl.trainer.actor import Actor
from megarl.trainer.batch import SequenceBatch
from megarl.weights.push import WeightPusher


def _broadcast(obj, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def build_controller(cfg, cluster: RolloutCluster) -> RolloutController:
    r = cfg.rollout
    tok = load_tokenizer(cfg.data.tokenizer_path or cfg.model.hf_path)
    dataset = PromptDataset(cfg.data.train_path, tok, prompt_key=cfg.data.prompt_key)
    sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              stop_token_ids=[tok.eos_id])
    workflow = load_workflow_class(r.workflow)(tok, load_reward_fn(r.reward_fn), sampling, r.group_size)
    return RolloutController(
        dataset, workflow, cluster.addresses, cluster, batch_groups=cfg.train.global_batch_size // r.group_size,
        max_staleness=r.max_staleness, max_concurrent=r.max_concurrent, seed=cfg.train.seed,
        api_key=r.api_key or None, dynamic_sampling=cfg.algo.dynamic_sampling)


def rollout_metrics(trajs: list[Trajectory], version: int) -> dict:
    lens = [t.response_len for t in trajs]
    stale = [version - t.min_version for t in trajs]
    return {"reward": statistics.fmean(t.reward for t in trajs), "response_len": statistics.fmean(lens),
            "staleness_mean": statistics.fmean(stale), "staleness_max": max(stale),
            "partial_frac": statistics.fmean(t.info.get("segments", 1) > 1 for t in trajs)}


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
    r = cfg.rollout
    with contextlib.ExitStack() as stack:
        servers = list(r.servers)
        if not servers and ps.rank == 0:
            servers = stack.enter_context(LocalCluster(
                cfg.model.hf_path, r.local_servers, f"{cfg.train.run_dir}/servers",
                extra=["--threads", r.server_threads],
                weights_roots=[cfg.weights.disk_dir or f"{cfg.train.run_dir}/weights"]))
        cluster = RolloutCluster.from_config(cfg, _broadcast(servers), driver=ps.rank == 0)
        stack.callback(cluster.close)
        actor = Actor.build(cfg, ps, engine)
        pusher = WeightPusher(cfg, engine, cluster)
        stack.callback(pusher.close)
        controller = build_controller(cfg, cluster) if ps.rank == 0 else None
        if controller is not None:
            ckpt.register("controller", controller)
        start = ckpt.resume()
        cluster.version = ckpt.policy_version  # the checkpoint records the version it was saved at
        pusher.push(bump=False)  # servers hold exactly the trainer's weights before any rollout
        if controller is not None:
            cluster.subscribe(controller)  # after the first push: nothing to pause before
            controller.start()
            stack.callback(controller.stop)
        groups = cfg.train.global_batch_size // r.group_size
        for step in progress(range(start + 1, cfg.train.steps + 1), desc="grpo", total=cfg.train.steps - start):
            trajs = _broadcast(controller.next_batch(groups) if controller else None)
            batch, rewards, group_ids = local_share(trajs, ps)
            batch = actor.with_advantages(batch, rewards, group_ids)
            metrics = actor.ppo_update(batch, version=cluster.version)
            metrics.update(rollout_metrics(trajs, cluster.version))
            metrics.update(pusher.push().as_dict())
            if controller is not None:
                metrics.update(controller.stats())
            if r.eval_interval and step % r.eval_interval == 0 or step == cfg.train.steps:
                acc = evaluate(cfg, cluster.addresses) if ps.rank == 0 else None
                if acc is not None:
                    metrics["eval_accuracy"] = acc
            logger.log(metrics, step)
            ckpt.maybe_save(step, last=step == cfg.train.steps, policy_version=cluster.version)
            maybe_export_hf(cfg, engine, step, last=step == cfg.train.steps)
        print0(f"[grpo] done: {cfg.train.steps} steps, policy version {cluster.version}")
