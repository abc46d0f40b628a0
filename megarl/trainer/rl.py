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
from megarl.data.chat import load_chat_template
from megarl.data.datasets import PromptDataset, balance_across_ranks
from megarl.data.tokenizer import load_tokenizer
from megarl.metrics import print0, progress
from megarl.rollout.cluster import RolloutCluster
from megarl.net import serving_host
from megarl.rollout.controller import RolloutController
from megarl.rollout.local import LocalCluster
from megarl.rollout.rewards import RewardCaller, load_reward_fn
from megarl.rollout.types import SamplingParams, Trajectory
from megarl.rollout.workflows import WorkflowContext, load_workflow
from megarl.trainer.actor import Actor
from megarl.trainer.batch import TensorBatch
from megarl.weights.push import WeightPusher


def _broadcast(obj, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def build_controller(cfg, cluster: RolloutCluster) -> RolloutController:
    r, d = cfg.rollout, cfg.data
    tok_path = d.tokenizer_path or cfg.model.hf_path
    tok, template = load_tokenizer(tok_path), load_chat_template(d.chat_template, tok_path)
    sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              stop_token_ids=[tok.eos_id])
    reward = RewardCaller(load_reward_fn(r.reward_fn, cfg.reward.args), cfg.reward.timeout_s, cfg.reward.on_error_value)
    workflow = load_workflow(r.workflow, WorkflowContext(tok, reward, sampling, r.group_size, template,
                                                         cfg.train.max_seq_len), r.workflow_args)
    dataset = PromptDataset(d.train_path, tok, prompt_key=d.prompt_key, answer_key=d.answer_key or None,
                            chat_template=template, max_prompt_length=d.max_prompt_length, truncation=d.truncation,
                            tools=getattr(workflow, "tool_schemas", None), shuffle=d.shuffle)
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


def local_share(trajs: list[Trajectory], ps) -> tuple:
    """(this DP rank's TensorBatch, its rewards [B], its group_ids [B]); the batch also carries
    both as sample fields."""
    mine = balance_across_ranks([len(t.input_ids) for t in trajs], ps.dp)[ps.dp_rank]
    batch = TensorBatch.from_trajectories([trajs[i] for i in mine])
    return batch, batch["rewards"], batch["group_ids"]


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


def run_rl(cfg, ps, engine, logger, ckpt, stop=None) -> None:
    r = cfg.rollout
    with contextlib.ExitStack() as stack:
        servers = list(r.servers)
        if not servers and ps.rank == 0:
            servers = stack.enter_context(LocalCluster(
                cfg.model.hf_path, r.local_servers, f"{cfg.train.run_dir}/servers",
                extra=["--threads", r.server_threads], host=serving_host()))
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
            # megarl.signals: same condition on every rank (the all-reduce runs on all or none)
            if stop is not None and step < cfg.train.steps and stop.should_stop():
                ckpt.save(step, policy_version=cluster.version)  # the next start resumes here
                break
            ckpt.maybe_save(step, last=step == cfg.train.steps, policy_version=cluster.version)
            maybe_export_hf(cfg, engine, step, last=step == cfg.train.steps)
        print0(f"[grpo] done: {cfg.train.steps} steps, policy version {cluster.version}")
