"""The asynchronous RL loop (GRPO family) on all trainer ranks.

    rank 0: controller thread generates groups ahead (bounded by the staleness window)
    every step, all ranks:
        groups   <- controller.next_batch()              (rank 0; broadcast to all ranks)
        share    <- token-balanced DP split
        share    <- actor.with_advantages(share)         (step-level group baselines)
        metrics  <- actor.ppo_update(share)              (prox recompute, PPO epochs, mini-batches)
        every train.trigger_parameter_sync_step steps: pusher.push(): pause rollouts -> push
        weights -> cluster.version + 1 -> resume (in-flight samples continue as partial
        rollouts, or finished under the old weights first without rollout.partial_rollout)
        every rollout.eval_interval steps (and at step 0 with rollout.eval_at_start): greedy
        held-out accuracy, run beside training and reported with the version it measured;
        train.stop_at_eval_accuracy ends the run once a reported accuracy reaches it
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
import dataclasses
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from megarl.algo.advantages import AdvantageEstimator
from megarl.algo.filters import overlong_penalty
from megarl.checkpoint import maybe_export_hf
from megarl.data.chat import load_chat_template
from megarl.data.datasets import PromptDataset, balance_across_ranks
from megarl.data.tokenizer import load_tokenizer
from megarl.metrics import print0, progress
from megarl.net import serving_host
from megarl.rollout.cluster import RolloutCluster
from megarl.rollout.controller import RolloutController
from megarl.rollout.evaluation import PeriodicEval
from megarl.rollout.local import LocalCluster, split_cpus
from megarl.rewards import RewardCaller
from megarl.rollout.types import SamplingParams, Trajectory
from megarl.rollout.workflows import WorkflowContext, load_workflow
from megarl.timeline import Timeline
from megarl.trainer.actor import Actor
from megarl.trainer.batch import TensorBatch
from megarl.trainer.critic import Critic
from megarl.trainer.rollout_stats import StepTimer, batch_metrics, dump_generations
from megarl.weights.push import WeightPusher
from megarl.weights.transports import PushError


def _broadcast(obj, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def groups_per_step(cfg) -> int:
    return cfg.train.step_batch_size // cfg.rollout.group_size


def task_parts(cfg, with_reward: bool = True):
    """(tokenizer, chat template, reward caller, sampling params) shared by training rollouts
    and evaluation: the same reward function and dataset fields for both."""
    r, d = cfg.rollout, cfg.data
    tok_path = d.tokenizer_path or cfg.model.hf_path
    tok, template = load_tokenizer(tok_path), load_chat_template(d.chat_template, tok_path)
    sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              stop_token_ids=None if r.ignore_eos else [tok.eos_id],  # a stop id stops even with ignore_eos
                              ignore_eos=r.ignore_eos)
    reward = RewardCaller.from_config(r.reward_fn, cfg.reward) if with_reward else None
    return tok, template, reward, sampling


def prompt_dataset(cfg, path: str, tok, template, tools=None) -> PromptDataset:
    d = cfg.data
    return PromptDataset(path, tok, prompt_key=d.prompt_key, answer_key=d.answer_key or None,
                         chat_template=template, max_prompt_length=d.max_prompt_length, truncation=d.truncation,
                         tools=tools, shuffle=d.shuffle)


def build_controller(cfg, cluster: RolloutCluster, timeline=None) -> RolloutController:
    r = cfg.rollout
    tok, template, reward, sampling = task_parts(cfg)
    workflow = load_workflow(r.workflow, WorkflowContext(tok, reward, sampling, r.group_size, template,
                                                         cfg.train.max_seq_len), r.workflow_args)
    dataset = prompt_dataset(cfg, cfg.data.train_path, tok, template, getattr(workflow, "tool_schemas", None))
    # the staleness clock ticks once per push, which covers trigger_parameter_sync_step steps
    per_version = groups_per_step(cfg) * cfg.train.trigger_parameter_sync_step
    return RolloutController(
        dataset, workflow, cluster.addresses, cluster, batch_groups=per_version,
        max_staleness=r.staleness, max_concurrent=r.max_concurrent, seed=cfg.train.seed,
        api_key=r.api_key or None, dynamic_sampling=cfg.algo.dynamic_sampling,
        partial_rollout=r.partial_rollout, max_retries=r.max_retries,
        failed_log=os.path.join(cfg.train.run_dir, "failed_prompts.jsonl"), timeline=timeline,
        sampling_seed=r.seed)


def local_share(trajs: list[Trajectory], ps) -> TensorBatch:
    """This DP rank's token-balanced share of the step as one padded batch (rewards and
    group_ids ride along as per-sample fields)."""
    mine = balance_across_ranks([len(t.input_ids) for t in trajs], ps.dp)[ps.dp_rank]
    return TensorBatch.from_trajectories([trajs[i] for i in mine])


def build_eval(cfg, reward: RewardCaller) -> Optional[PeriodicEval]:
    """Held-out evaluation with the configured dataset fields and the training rollouts' reward
    caller (rank 0; one set of reward threads / worker processes, its counts include eval)."""
    if not cfg.data.eval_path:
        return None
    tok, template, _, sampling = task_parts(cfg, with_reward=False)
    samples = prompt_dataset(cfg, cfg.data.eval_path, tok, template).samples[:cfg.rollout.eval_size]
    if cfg.rollout.ignore_eos:  # evaluation answers stop at EOS whatever the training rollouts do
        sampling = dataclasses.replace(sampling, ignore_eos=False, stop_token_ids=[tok.eos_id])
    return PeriodicEval(samples, reward, sampling, tok, k=cfg.rollout.eval_k)


def shape_rewards(trajs: list[Trajectory], spec, max_new_tokens: int) -> dict:
    """DAPO overlong shaping (algo.overlong_*) added to each sample's outcome reward, in place
    and identically on every rank (all ranks hold the broadcast batch)."""
    if not spec.overlong_buffer_len:
        return {}
    lengths = torch.tensor([t.response_len for t in trajs])
    penalty = overlong_penalty(lengths, max_new_tokens, spec.overlong_buffer_len,
                               spec.overlong_penalty_factor)
    for t, p in zip(trajs, penalty.tolist()):
        t.info["reward_raw"] = t.reward
        t.reward += p
    return {"overlong_penalty_mean": float(penalty.mean()), "overlong_frac": float((penalty < 0).float().mean())}


def train_step(actor: Actor, critic: Optional[Critic], batch: TensorBatch, version: int) -> dict:
    """Advantages, then the critic's value update (GAE) and the policy update; during
    critic.warmup_steps only the critic learns."""
    if critic is not None:
        batch = batch.with_fields(values=critic.values(batch))  # V_old: the step-start values
    batch = actor.with_advantages(batch)
    metrics = {}
    if critic is not None:
        metrics.update({f"critic/{k}": v for k, v in critic.update(batch).items()})
        if critic.updates <= actor.cfg.critic.warmup_steps:  # this update was a warm-up one
            metrics["critic/warmup"] = 1.0
            return metrics
    metrics.update(actor.ppo_update(batch, version=version))
    return metrics


def verify_push(pusher: WeightPusher) -> int:
    """weights.verify_interval: the servers must hold exactly the pushed tensors."""
    bad = sorted(pusher.verify())
    if bad:
        raise PushError(f"weights.verify_interval: {len(bad)} tensor(s) differ on the servers after "
                        f"version {pusher.version}: {', '.join(bad[:5])}")
    return 0


def start_rollout_side(cfg, ps, stack: contextlib.ExitStack) -> tuple[RolloutCluster, Optional[LocalCluster]]:
    """This rank's `RolloutCluster` over rollout.servers, or over CPU servers rank 0 starts itself
    when the list is empty (relaunched on their port if they die); both closed by `stack`."""
    r, t = cfg.rollout, cfg.train
    servers, local = list(r.servers), None
    if not servers and ps.rank == 0:
        server_cpus, trainer_cpus = split_cpus(r.server_cpus) if r.server_cpus else (None, None)
        local = LocalCluster(cfg.model.hf_path, r.local_servers, f"{t.run_dir}/servers",
                             extra=["--threads", r.server_threads, *r.server_args], host=serving_host(),
                             weights_roots=[cfg.weights.disk_dir or f"{t.run_dir}/weights"],
                             cpus=server_cpus)
        servers = stack.enter_context(local)
        if trainer_cpus:  # generation and training on their own cores (docs/demo.md)
            os.sched_setaffinity(0, trainer_cpus)
    cluster = RolloutCluster.from_config(cfg, _broadcast(servers), driver=ps.rank == 0)
    if local is not None:
        cluster.restart = local.restart
    stack.callback(cluster.close)
    return cluster, local


@dataclasses.dataclass
class StepRunner:
    """One RL step on every rank: wait for a batch, update, push, evaluate, collect the metrics.
    `controller` and `evaluator` exist on rank 0 only; `local` when rank 0 started the servers."""
    cfg: Any
    ps: Any
    cluster: RolloutCluster
    local: Optional[LocalCluster]
    actor: Actor
    critic: Optional[Critic]
    pusher: WeightPusher
    controller: Optional[RolloutController]
    evaluator: Optional[PeriodicEval]
    timer: StepTimer
    bad_steps: int = 0  # consecutive steps with a skipped (non-finite) update

    def run(self, step: int, last: bool) -> tuple[dict, bool]:
        """This step's metrics, and whether train.stop_at_eval_accuracy was reached."""
        trajs = self._next_batch()
        metrics = self._update(trajs, step)
        if step % self.cfg.train.trigger_parameter_sync_step == 0 or last:
            self._push(metrics)
        metrics["policy_version"] = self.cluster.version
        if self.evaluator is not None:
            self._evaluate(step, last, metrics)
        reached = self._reached(metrics, last)
        self._report(metrics, trajs)
        return metrics, reached

    def _next_batch(self) -> list[Trajectory]:
        with self.timer.phase("wait"):
            # one broadcast: the batch, and the dropped servers that answer /health again
            c = self.controller
            trajs, rejoin = _broadcast((c.next_batch(groups_per_step(self.cfg)),
                                        self.cluster.ready_to_rejoin()) if c else None)
        for address in rejoin:  # current weights first, then work
            with self.timer.phase("rejoin"):
                self.pusher.add_server(address)
        return trajs

    def _update(self, trajs: list[Trajectory], step: int) -> dict:
        cfg = self.cfg
        shaping = shape_rewards(trajs, self.actor.spec, cfg.rollout.max_new_tokens)
        batch = local_share(trajs, self.ps)
        with self.timer.phase("update"):
            metrics = train_step(self.actor, self.critic, batch, self.cluster.version)
        metrics.update(shaping)
        self.bad_steps = self.bad_steps + 1 if metrics.get("skipped_updates", 0) > 0 else 0
        if self.bad_steps >= cfg.train.max_nonfinite_steps:
            raise FloatingPointError(
                f"train.max_nonfinite_steps: {self.bad_steps} steps in a row had a NaN/inf gradient "
                f"(last grad_norm {metrics.get('grad_norm')}, loss {metrics.get('loss')}); "
                "updates were skipped, weights are the last good ones")
        metrics.update(batch_metrics(trajs, self.cluster.version))
        if cfg.logging.dump_generations and self.ps.rank == 0:
            dump_generations(f"{cfg.train.run_dir}/generations.jsonl", step, self.cluster.version, trajs)
        return metrics

    def _push(self, metrics: dict) -> None:
        with self.timer.phase("push"):
            metrics.update(self.pusher.push().as_dict())
        every = self.cfg.weights.verify_interval
        if every and self.cluster.version % every == 0:
            with self.timer.phase("verify"):
                metrics["push/verify_mismatches"] = verify_push(self.pusher)

    def _evaluate(self, step: int, last: bool, metrics: dict) -> None:
        interval = self.cfg.rollout.eval_interval
        if interval and step % interval == 0 or last:
            self.evaluator.submit(self.controller, step, self.cluster.version)  # runs beside training
        with self.timer.phase("eval"):  # only the last step waits for its evaluation
            metrics.update(self.evaluator.poll(wait=last))

    def _reached(self, metrics: dict, last: bool) -> bool:
        target = self.cfg.train.stop_at_eval_accuracy
        if not target or last:
            return False
        # rank 0 decides for every rank
        return _broadcast(metrics.get("eval_accuracy", -1.0) >= target if self.ps.rank == 0 else None)

    def _report(self, metrics: dict, trajs: list[Trajectory]) -> None:
        c = self.controller
        metrics.update({"rollout/live_servers": len(self.cluster.addresses),
                        "rollout/dead_servers": len(self.cluster.dead)})
        if self.local is not None:
            metrics["rollout/restarts"] = self.local.restarts
        if c is not None:
            metrics.update(c.stats())
        metrics.update(self.timer.finish(
            metrics, c.client.busy_seconds() if c else None, c.client.stats["tokens"] if c else None,
            trained_tokens=sum(len(x.input_ids) for x in trajs)))


def run_rl(cfg, ps, engine, logger, ckpt, stop=None) -> None:
    r, t = cfg.rollout, cfg.train
    with contextlib.ExitStack() as stack:
        cluster, local = start_rollout_side(cfg, ps, stack)
        timeline = Timeline(f"{t.run_dir}/timeline/rank{ps.rank}.jsonl" if cfg.logging.timeline and
                            ps.rank == 0 else None)
        stack.callback(timeline.close)
        actor = Actor.build(cfg, ps, engine)
        critic = Critic.build(cfg, ps) if actor.spec.advantage.estimator == AdvantageEstimator.GAE else None
        if critic is not None:
            ckpt.add_engine("critic", critic.engine)
        pusher = WeightPusher(cfg, engine, cluster)
        stack.callback(pusher.close)
        controller = build_controller(cfg, cluster, timeline) if ps.rank == 0 else None
        if controller is not None:
            ckpt.register("controller", controller)
        start = ckpt.resume()
        cluster.version = ckpt.policy_version  # the checkpoint records the version it was saved at
        actor.updates = start  # one PPO update per step: the mini-batch shuffle continues where it was
        if critic is not None:
            critic.updates = start  # and so does the critic's (and its warm-up count)
        pusher.push(bump=False)  # servers hold exactly the trainer's weights before any rollout
        if controller is not None:
            cluster.subscribe(controller)  # after the first push: nothing to pause before
            controller.start()
            stack.callback(controller.stop)
        evaluator = build_eval(cfg, controller.reward) if controller is not None else None
        if evaluator is not None and r.eval_at_start and start == 0:  # the learning curve's step 0
            evaluator.submit(controller, 0, cluster.version)
            logger.log({**evaluator.poll(wait=True), "policy_version": cluster.version}, 0)
        runner = StepRunner(cfg, ps, cluster, local, actor, critic, pusher, controller, evaluator,
                            StepTimer(timeline))
        step = start
        for step in progress(range(start + 1, t.steps + 1), desc="grpo", total=t.steps - start):
            last = step == t.steps
            metrics, reached = runner.run(step, last)
            logger.log(metrics, step)
            # megarl.signals: same condition on every rank (the all-reduce runs on all or none)
            if stop is not None and not last and stop.should_stop():
                ckpt.save(step, policy_version=cluster.version)  # the next start resumes here
                break
            ckpt.maybe_save(step, last=last or reached, policy_version=cluster.version)
            maybe_export_hf(cfg, engine, step, last=last or reached)
            if reached:
                print0(f"[grpo] eval accuracy reached train.stop_at_eval_accuracy="
                       f"{t.stop_at_eval_accuracy} (measured at step {metrics.get('eval/step')}); "
                       f"stopping at step {step}")
                break
        print0(f"[grpo] done: {step} of {t.steps} steps, policy version {cluster.version}")
