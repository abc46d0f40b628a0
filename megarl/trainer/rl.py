"""The asynchronous RL loop (GRPO family) on all trainer ranks.

    rollout manager (its own process, megarl.rollout.manager): generates groups ahead
        (bounded by the staleness window), scores them, evaluates
    every step, all ranks (the step keeps one form, flat arrays, from the socket to the loss):
        step     <- side.next_batch()   (rank 0 reads the manager's Batch - flat arrays laid out
                                         as the trainer's batch, samples ordered by DP rank; one
                                         byte broadcast gives every rank the arrays)
        share    <- step.share(dp_rank) (this DP rank's whole groups, token-balanced by the
                                         manager: one contiguous run, padded into a TensorBatch
                                         by one masked assignment per field)
        share    <- actor.step_fields(share, values)  (the one place the step's computed fields
                                         join: critic values, ref/prox logprobs, advantages and
                                         returns - group baselines need no other rank; step-wide
                                         whitening all-reduces a few scalars)
        metrics  <- critic.update(share), actor.ppo_update(share)   (PPO epochs, mini-batches)
        rollout metrics from the step's arrays; infos (rank 0) for shaping metrics and dumps
        every train.trigger_parameter_sync_step steps: pusher.push(): pause rollouts -> push
        weights -> cluster.version + 1 -> resume (in-flight samples continue as partial
        rollouts, or finished under the old weights first without rollout.partial_rollout)
        and, every weights.verify_interval pushes, compare per-tensor checksums with the servers'
        gates (megarl/trainer/gates.py): the step's metrics are logged, then train.mismatch_gate
        stops the run if tokens of the step's own version disagree with the trainer's logprobs
        every rollout.eval_interval steps (and at step 0 with rollout.eval_at_start): greedy
        held-out accuracy, run beside training and reported with the version it measured;
        train.stop_at_eval_accuracy ends the run once a reported accuracy reaches it
    at the end, train.py writes run_dir/learning_curve.png (megarl/common/plotting.py)

The four modes of seed 003 are config alone (docs/async.md):
    on-policy           max_staleness 0, trigger 1
    stream off-policy   max_staleness 0, trigger k       (k steps per push, one version)
    async, stale        max_staleness > 0 or staleness_threshold > 0, partial_rollout false
    async, partial      the same with partial_rollout true (the default)

The trainer's `ManagerCluster` (every rank) counts the policy version; rank 0 forwards each push's
protocol steps to the manager's `RolloutCluster`, whose listener is the controller, so a push
pauses and resumes generation exactly once. No trainer rank runs an event loop.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Optional

import torch.distributed as dist

from megarl.algo.choices import AdvantageEstimator
from megarl.checkpoint import maybe_export_hf
from megarl.trainer.metrics import print0, progress
from megarl.protocol.channel import ManagerStalled
from megarl.protocol.messages import eval_due
from megarl.protocol.packing import groups_per_step
from megarl.common.timeline import Timeline
from megarl.trainer.actor import Actor
from megarl.trainer.batch import TensorBatch
from megarl.trainer.critic import Critic, CriticSpec
from megarl.trainer.gates import check_mismatch, mismatch_threshold, verify_push
from megarl.trainer.handoff import ReceivedStep
from megarl.trainer.rollout_link import ManagerCluster, ManagerState, RolloutSide
from megarl.trainer.rollout_stats import StepTimer, batch_metrics, dump_generations
from megarl.weights.flight import FLIGHT_THREAD
from megarl.trainer.threads import ThreadSplit
from megarl.weights.push import PushSpec, WeightPusher


def _broadcast(obj, src: int = 0):
    box = [obj]
    # pickled and broadcast over the default group: every rank holds the same object afterwards
    dist.broadcast_object_list(box, src=src)
    return box[0]


def shaping_metrics(infos: list[dict]) -> dict:
    """overlong_* metrics of DAPO's overlong shaping (algo.overlong_*), which the rollout manager
    applied to each group before dynamic sampling (megarl.rollout.shaping): the rewards arrive
    shaped, each sample's penalty in info["overlong_penalty"] (rank 0 holds the infos)."""
    penalties = [i["overlong_penalty"] for i in infos if "overlong_penalty" in i]
    if not penalties:
        return {}
    return {"overlong_penalty_mean": sum(penalties) / len(penalties),
            "overlong_frac": sum(p < 0 for p in penalties) / len(penalties)}


def train_step(actor: Actor, critic: Optional[Critic], batch: TensorBatch, version: int) -> dict:
    """The step's computed fields (`Actor.step_fields`: V_old, ref/prox logprobs, advantages),
    then the critic's value update (GAE) and the policy update; during critic.warmup_steps only
    the critic learns."""
    warm = critic is not None and critic.warming_up  # decided before this step's critic update
    # V_old: the step-start values; everything is computed once, before any update
    values = critic.values(batch) if critic is not None else None
    batch, stats = actor.step_fields(batch, version, values=values, update=not warm)
    metrics = {}
    if critic is not None:
        metrics.update({f"critic/{k}": v for k, v in critic.update(batch).items()})
        if warm:
            metrics["critic/warmup"] = 1.0
            return metrics
    metrics.update(actor.ppo_update(batch, version, stats))
    return metrics


@dataclasses.dataclass
class StepRunner:
    """One RL step on every rank: wait for a batch, update, push, evaluate, collect the metrics.
    `side` talks to the rollout manager (rank 0 holds the link; other ranks get the step by
    broadcast)."""
    cfg: Any
    ps: Any
    cluster: ManagerCluster
    side: RolloutSide
    actor: Actor
    critic: Optional[Critic]
    pusher: WeightPusher
    timer: StepTimer
    bad_steps: int = 0  # consecutive steps with a skipped (non-finite) update
    trained_version: int = 0  # the policy version the last step started from
    updates_since_push: int = 0  # optimizer updates the servers' weights lag behind the trainer's
    pushed_weights: bool = True  # the last step started from exactly the weights the servers hold
    threads: Optional[ThreadSplit] = None  # train.torch_threads auto: the update's threads, per step

    def check_gates(self, metrics: dict, step: int) -> None:
        """train.mismatch_gate on a logged step (every rank holds the same reduced metrics). Only
        a step that started from the weights last pushed compares like with like: with
        train.trigger_parameter_sync_step = k the trainer updates k-1 times between pushes while
        the version (and the servers' weights) stay."""
        if self.pushed_weights:
            check_mismatch(mismatch_threshold(self.cfg), metrics, step, self.trained_version)

    def run(self, step: int, last: bool) -> tuple[dict, bool]:
        """This step's metrics, and whether train.stop_at_eval_accuracy was reached."""
        received = self._next_batch()
        # decided before the update: the mismatch gate compares against weights the servers really hold
        self.pushed_weights = self.updates_since_push == 0
        colocated = self.cfg.rollout.placement == "colocated"
        if colocated:  # the batch is complete: the servers give their memory to training
            self._sleep_servers()
        metrics = self._update(received, step)
        self.updates_since_push += 1
        if colocated:
            self._wake_servers()
        # the last step always pushes: the servers (and the final evaluation) see the final weights
        if step % self.cfg.train.trigger_parameter_sync_step == 0 or last:
            self._push(metrics, land=last or self._eval_due(step))
            self.updates_since_push = 0
        metrics["policy_version"] = self.cluster.version
        if eval_intervals(self.cfg):
            self._evaluate(step, last, metrics)
        reached = self._reached(metrics, last)
        self._report(metrics, received)
        return metrics, reached

    def _next_batch(self) -> ReceivedStep:
        with self.timer.phase("wait"), (self.threads.waiting() if self.threads else contextlib.nullcontext()):
            # the batch, and the dropped servers that answer /health again (received.rejoin)
            # the version that trains it (no push until _update): the manager's hard cap counts from it
            received = self.side.next_batch(groups_per_step(self.cfg), self.cfg.train.stall_timeout_s,
                                            self.cluster.version)
        if received.rejoin and self.threads is not None:
            self.threads.server_restarted()  # back at its start count
        for address in received.rejoin:  # current weights first, then work
            with self.timer.phase("rejoin"):
                self.pusher.add_server(address)
        return received

    def _update(self, received: ReceivedStep, step: int) -> dict:
        cfg = self.cfg
        shaping = shaping_metrics(received.infos)
        batch = received.share(self.ps.dp_rank)
        # the version the batch's step starts from; the push after it makes version + 1
        self.trained_version = self.cluster.version
        with self.timer.phase("update"):
            if self.threads is not None:
                self.threads.before_update()
            try:
                metrics = train_step(self.actor, self.critic, batch, self.cluster.version)
            finally:
                if self.threads is not None:
                    self.threads.after_update()
            # the rollout side lives in the manager process: nothing else runs Python here but an
            # overlapped push's flight (weights.overlap), counted apart
            flights = sum(t.name.startswith(FLIGHT_THREAD) for t in threading.enumerate())
            metrics["trainer/python_threads"] = threading.active_count() - flights
            metrics["trainer/push_threads"] = flights
        metrics.update(shaping)
        # only consecutive non-finite steps count: one good step shows the run can go on
        self.bad_steps = self.bad_steps + 1 if metrics.get("skipped_updates", 0) > 0 else 0
        if self.bad_steps >= cfg.train.max_nonfinite_steps:
            raise FloatingPointError(
                f"train.max_nonfinite_steps: {self.bad_steps} steps in a row had a NaN/inf gradient "
                f"(last grad_norm {metrics.get('grad_norm')}, loss {metrics.get('loss')}); "
                "updates were skipped, weights are the last good ones")
        metrics.update(batch_metrics(received, self.cluster.version))
        if cfg.logging.dump_generations and self.ps.rank == 0:
            dump_generations(f"{cfg.train.run_dir}/generations.jsonl", step, self.cluster.version, received)
        return metrics

    def _sleep_servers(self) -> None:
        with self.timer.phase("sleep"):
            if self.ps.rank == 0:
                self.cluster.sleep(self.cfg.rollout.sleep_tags)

    def _wake_servers(self) -> None:
        """Before the push (every step: colocated is on-policy with one update per push)."""
        with self.timer.phase("wake"):
            if self.ps.rank == 0:
                self.cluster.wake(self.cfg.rollout.sleep_tags)
            if "weights" in self.cfg.rollout.sleep_tags:
                self.pusher.forget_sent()  # the servers hold zeros until every tensor is sent

    def _push(self, metrics: dict, land: bool) -> None:
        """The step's push. Overlapped (weights.overlap), it returns once its buckets are staged
        and lands later - at the next push, or here when ``land`` (the last step, an evaluating
        one: the servers must hold this version) - and checks its own checksums in its flight."""
        with self.timer.phase("push"):
            try:
                metrics.update(self.pusher.push().as_dict())
                if land and self.pusher.flight is not None:
                    landed = self.pusher.land_or_repush()
                    metrics.update({**landed.as_dict(), "push/blocking_s": metrics["push/blocking_s"]
                                    + landed.total_s - landed.overlapped_s})
            except ManagerStalled as e:  # seen by a transport while its bytes waited on the manager
                raise self.side._died(e) from None
        if not self.pusher.overlap and self.pusher.verify_due(self.cluster.version):  # weights.verify_interval
            with self.timer.phase("verify"):
                metrics["push/verify_mismatches"] = verify_push(self.pusher, self.cfg.weights.verify_mode)

    def _eval_due(self, step: int) -> bool:
        return any(eval_due(interval, step, self.cfg.train.steps) for interval in eval_intervals(self.cfg))

    def _evaluate(self, step: int, last: bool, metrics: dict) -> None:
        # run() calls this after the step's push (if any): it evaluates the version the servers hold
        # now; the manager evaluates the sets due at this step (data.eval_sets: each its interval)
        due = self._eval_due(step)
        if due:
            self.side.submit_eval(step, self.cluster.version)  # runs beside training, in the manager
        # only the last step waits for its evaluation - and, colocated, every evaluating step: the
        # servers sleep during the next update, and must evaluate the version they hold now
        wait = last or (due and self.cfg.rollout.placement == "colocated")
        with self.timer.phase("eval"):
            metrics.update(self.side.poll_eval(wait=wait, timeout_s=self.cfg.train.stall_timeout_s))

    def _reached(self, metrics: dict, last: bool) -> bool:
        target = self.cfg.train.stop_at_eval_accuracy
        if not target or last:
            return False
        # rank 0 decides for every rank
        # rank 0 alone has the evaluation's numbers; every rank must agree to stop at the same step
        return _broadcast(metrics.get("eval_accuracy", -1.0) >= target if self.ps.rank == 0 else None)

    def _report(self, metrics: dict, received: ReceivedStep) -> None:
        stats = received.stats
        metrics.update(stats)
        metrics.update(self.timer.finish(
            metrics, stats.get("rollout/busy_s"), stats.get("rollout/tokens"), trained_tokens=received.tokens))
        if self.threads is not None:
            metrics.update(self.threads.observe(metrics.get("rollout_idle_ratio"), metrics.get("time/update"),
                                                received.tokens, metrics.get("trainer_idle_ratio"),
                                                metrics.get("time/wait")))


def eval_intervals(cfg) -> list[int]:
    """The evaluation interval of each held-out set (data.eval_sets, else data.eval_path's);
    empty: the run does not evaluate."""
    r = cfg.rollout
    if cfg.data.eval_sets:
        return [r.eval_interval if s.interval is None else s.interval for s in cfg.data.eval_sets]
    return [r.eval_interval] if cfg.data.eval_path else []


def connect_rollout_side(cfg, ps, ckpt, side: RolloutSide) -> tuple[int, ManagerCluster]:
    """Resume (the manager's ledger is part of the checkpoint), then hand the manager its state
    and the trainer's version; returns the trainer's view of the server set."""
    ledger = ManagerState(side)
    ckpt.register("controller", ledger)  # the name older checkpoints saved the ledger under
    # resume first: the manager must receive the restored ledger before it issues any prompt
    start = ckpt.resume()
    cluster = side.connect(ckpt.policy_version, ledger.loaded if ps.rank == 0 else None)
    return start, cluster


def run_rl(cfg, ps, engine, logger, ckpt, stop=None, side: Optional[RolloutSide] = None,
           threads: Optional[ThreadSplit] = None) -> None:
    r, t = cfg.rollout, cfg.train
    with contextlib.ExitStack() as stack:
        if side is None:  # train.py starts it before the engine build; tests may not
            side = RolloutSide(cfg, ps)
            side.start()
        stack.callback(side.close)
        timeline = Timeline(f"{t.run_dir}/timeline/rank{ps.rank}.jsonl" if cfg.logging.timeline and
                            ps.rank == 0 else None)
        stack.callback(timeline.close)
        actor = Actor.build(cfg, ps, engine)
        gae = actor.spec.advantage.estimator == AdvantageEstimator.GAE
        critic = Critic.build(CriticSpec.from_config(cfg), ps) if gae else None
        if critic is not None:
            ckpt.add_engine("critic", critic.engine)
        start, cluster = connect_rollout_side(cfg, ps, ckpt, side)
        actor.updates = start  # one PPO update per step: the mini-batch shuffle continues where it was
        if critic is not None:
            critic.updates = start  # and so does the critic's (and its warm-up count)
        pusher = WeightPusher(PushSpec.from_config(cfg), engine, cluster)
        stack.callback(pusher.close)
        stack.callback(side.kill_if_stalled)  # before pusher.close (RolloutSide.kill_if_stalled)
        pusher.push(bump=False)  # servers hold exactly the trainer's weights before any rollout
        if pusher.verify_due(cluster.version):  # a server that cannot hold them fails here, before work
            verify_push(pusher, cfg.weights.verify_mode)
        side.start_rollouts()  # after the first push: nothing to pause before
        if eval_intervals(cfg) and r.eval_at_start and start == 0:  # the learning curve's step 0
            side.submit_eval(0, cluster.version)
            first = side.poll_eval(wait=True, timeout_s=t.stall_timeout_s)
            logger.log({**first, "policy_version": cluster.version}, 0)
        if threads is not None and threads.lend and cluster.driver:  # the servers may take its cores while it waits
            threads.send = cluster.set_server_threads
        runner = StepRunner(cfg, ps, cluster, side, actor, critic, pusher, StepTimer(timeline), threads=threads)
        step = start
        for step in progress(range(start + 1, t.steps + 1), desc="grpo", total=t.steps - start):
            last = step == t.steps
            metrics, reached = runner.run(step, last)
            logger.log(metrics, step)
            runner.check_gates(metrics, step)  # after the log: the numbers are in metrics.jsonl
            # megarl.common.signals: same condition on every rank (the all-reduce runs on all or none)
            if stop is not None and not last and stop.should_stop():
                # a stop signal: save now, whatever the interval, so no finished step is lost
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
