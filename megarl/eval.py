"""megarl-eval CONFIG.yaml [a.b=c ...] -- score a model on the held-out set, without training.

    model    <- eval.checkpoint: a Megatron checkpoint, exported to HF in a temporary directory
                (megarl-convert mcore-to-hf, one process, any layout); empty: model.hf_path (HF)
    servers  <- rollout.local_servers of rollout.engine started on that HF directory: no trainer
                rank, no Megatron - the servers are all the model needs
    result   <- the run's own evaluation (megarl.rollout.evaluation, built by build_eval): the
                configured rollout.workflow and rollout.reward_fn on data.eval_path (the first
                rollout.eval_size prompts), greedy pass@1 and, with rollout.eval_k = k > 0, pass@k
                from eval.n >= k sampled episodes per prompt (unbiased estimator); with
                data.eval_sets every set, each with its own size, k, reward and workflow
    output   <- <eval.out_dir>/samples.jsonl (every episode, named by its eval_set),
                <eval.out_dir>/results.json (several sets: under sets.<name>), and one summary
                line on stdout

The same contract as megarl-train: the config and what it points at are checked before anything
starts (one line ``megarl-eval: <field>: <problem>``, exit status 2); a later error is one line,
exit status 1; ``--debug`` shows the traceback. The two files are written aside and renamed, so
an evaluation that fails leaves no half-written output (and an earlier evaluation's files whole).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time

from megarl.common.cli import config_args, pop_debug, run_main
from megarl.config import ConfigError, load_config

PROG = "megarl-eval"


def main(argv: list[str] | None = None) -> int:
    argv, debug = pop_debug(sys.argv[1:] if argv is None else argv)
    path, overrides = config_args(PROG, __doc__, argv)
    return run_main(PROG, lambda: run(path, overrides), debug, expected=(ConfigError,), code=2)


def run(path: str, overrides: list[str]) -> int:
    cfg = load_config(path, overrides)
    ckpt = check_inputs(cfg)
    out_dir = output_dir(cfg)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="megarl-eval-") as tmp:
        model_dir = export_hf(ckpt, os.path.join(tmp, "hf")) if ckpt else cfg.model.hf_path
        scored = evaluate_model(cfg, model_dir, os.path.join(out_dir, "servers"))
    results = summarize(cfg, scored, ckpt, time.perf_counter() - t0)
    write_outputs(out_dir, results, [{**({"eval_set": name} if name else {}), **row}
                                     for name, _, res in scored for row in res.rows])
    print(summary_line(results, out_dir), flush=True)
    return 0


# ----------------------------------------------------------------------------- inputs

def output_dir(cfg) -> str:
    return cfg.eval.out_dir or os.path.join(os.path.abspath(cfg.train.run_dir), "eval")


def check_inputs(cfg) -> str:
    """The checks megarl-train runs on the same fields (megarl.launch.preflight), before anything starts;
    returns the resolved Megatron checkpoint (eval.checkpoint), or '' for the HF model."""
    from megarl.launch import preflight

    if not cfg.train.is_rl:
        raise ConfigError("train.algorithm: megarl-eval scores an RL task (rollout.workflow, rollout.reward_fn); "
                          f"got {cfg.train.algorithm}")
    if not cfg.data.eval_path and not cfg.data.eval_sets:
        raise ConfigError("data.eval_path: megarl-eval needs a held-out file (JSONL or Parquet; several: data.eval_sets)")
    if cfg.rollout.servers:
        raise ConfigError("rollout.servers: megarl-eval starts its own servers on the model it scores; "
                          f"leave it empty (got {cfg.rollout.servers[0]})")
    if cfg.eval.checkpoint:
        ckpt = resolve_eval_checkpoint(cfg)
        args = checkpoint_model_args(ckpt)
        if not cfg.data.tokenizer_path:
            cfg.data.tokenizer_path = ckpt  # megarl copies the tokenizer into every checkpoint
    else:
        if not cfg.model.hf_path:
            raise ConfigError("model.hf_path: the HF model to evaluate (or set eval.checkpoint)")
        ckpt, args = "", preflight.check_model(cfg)
    tok = preflight.check_tokenizer(cfg, args.vocab_size)
    if cfg.data.eval_path:
        preflight.check_dataset("data.eval_path", cfg.data.eval_path, cfg, tok, args.max_position_embeddings)
    preflight.check_eval_sets(cfg, tok, args.max_position_embeddings)
    preflight.check_plugins(cfg)
    preflight.check_writable("eval.out_dir", output_dir(cfg))
    if not cfg.rollout.servers and cfg.rollout.engine == "sglang":
        from megarl.rollout.sglang_local import check_model_dir, sglang_python
        sglang_python()
        if not ckpt:
            check_model_dir(cfg.model.hf_path)
    return ckpt


def resolve_eval_checkpoint(cfg) -> str:
    """eval.checkpoint as a complete, intact checkpoint directory (latest: checkpoint.save_dir's)."""
    from megarl.checkpoint import CheckpointError, resolve_checkpoint, verify_checkpoint

    path = cfg.eval.checkpoint
    if path == "latest":
        path = cfg.checkpoint.save_dir or os.path.join(cfg.train.run_dir, "checkpoints")
    try:
        ckpt = resolve_checkpoint(path)
        verify_checkpoint(ckpt)  # every file there and whole, tensors only (no pickled objects)
    except CheckpointError as e:
        raise ConfigError(f"eval.checkpoint: {e}") from None
    if not os.path.isfile(os.path.join(ckpt, "config.json")):
        raise ConfigError(f"eval.checkpoint: {ckpt} has no config.json (megarl writes one into every checkpoint)")
    return ckpt


def checkpoint_model_args(ckpt: str):
    from megarl.protocol.hf_model import read_model_args

    try:
        return read_model_args(ckpt)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"eval.checkpoint: {e}") from None


# ----------------------------------------------------------------------------- the model, served

def export_hf(ckpt: str, out: str) -> str:
    """The checkpoint as an HF directory, by megarl-convert mcore-to-hf in a child process (it
    initialises torch.distributed for itself; this process stays free of it)."""
    cmd = [sys.executable, "-m", "megarl.commands.convert", "mcore-to-hf", "--ckpt", ckpt, "--out", out]
    print(f"[{PROG}] exporting {ckpt} to HF", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        lines = [x for x in proc.stderr.splitlines() if x.strip()]
        raise RuntimeError(f"exporting eval.checkpoint {ckpt} failed: {lines[-1] if lines else proc.returncode}")
    return out


def local_servers(cfg, model_dir: str, log_dir: str):
    """rollout.local_servers servers of rollout.engine on ``model_dir``, as the rollout manager
    starts them (flags, threads, CPUs), without a weights root: nothing is pushed to them."""
    from megarl.rollout.local import LocalServers

    r = cfg.rollout
    cpus = set(r.server_cpus) & os.sched_getaffinity(0) if r.server_cpus else None
    launcher = None
    if r.engine == "sglang":
        from megarl.rollout.sglang_local import SGLangLauncher
        launcher = SGLangLauncher(model_dir, list(r.server_args), threads=r.server_threads, api_key=r.api_key)
    return LocalServers(model_dir, r.local_servers, log_dir, extra=["--threads", r.server_threads, *r.server_args],
                        cpus=cpus, launcher=launcher, ready_timeout_s=r.health_timeout_s, api_key=r.api_key)


def evaluate_model(cfg, model_dir: str, log_dir: str) -> list:
    """The run's evaluation (build_eval: workflow, reward, prompts) against servers on ``model_dir``:
    [(set name, its TaskSpec, EvalResult)], one per held-out set (data.eval_sets, in order), or
    one with name "" for data.eval_path."""
    import asyncio

    from megarl.rollout.client import RolloutClient
    from megarl.rollout.evaluation import evaluate
    from megarl.common.net import LOOPBACK
    from megarl.rollout.setup import EvalSpec, TaskSpec, build_eval, eval_reward, task_parts
    from megarl.rollout.sources import eval_set_tasks
    from megarl.rollout.workflows.base import close_envs

    if not cfg.rollout.api_key:  # the servers started here answer only this command (megarl.rollout.local)
        cfg.rollout.api_key = secrets.token_urlsafe(32)
    task = TaskSpec.from_config(cfg)  # tokenizer: data.tokenizer_path (the checkpoint's), else model.hf_path
    os.makedirs(log_dir, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if cfg.reward.model.path and not cfg.rollout.eval_reward_fn:  # scored by the reward model: serve it
            from megarl.rollout.reward_servers import RewardServers, task_with_reward_urls

            rm = RewardServers(cfg.reward.model, os.path.join(log_dir, "reward_servers"), LOOPBACK,
                               ready_timeout_s=cfg.rollout.health_timeout_s)
            task = task_with_reward_urls(task, stack.enter_context(rm), rm.api_key)
        if cfg.env.cls:  # an environment the job serves: served here as in training
            import dataclasses

            from megarl.rollout.env_servers import env_servers
            from megarl.rollout.setup import env_spec

            es = env_servers(cfg.env, os.path.join(log_dir, "env_servers"), LOOPBACK,
                             ready_timeout_s=cfg.rollout.health_timeout_s)
            task = dataclasses.replace(task, env=env_spec(stack.enter_context(es), es.api_key, cfg.env))
        # rollout.eval_reward_fn: the evaluation scores with it and training's reward is not built
        reward = eval_reward(task, None if cfg.rollout.eval_reward_fn else task_parts(task)[2])
        built = build_eval(EvalSpec(task, n=cfg.eval.n), reward)
        if cfg.data.eval_sets:
            tasks = list(eval_set_tasks(task).values())
            sets = [(name, sub, ev) for (name, ev, _), sub in zip(built.sets, tasks)]
        else:
            sets = [("", task, built)]
        owned = [getattr(getattr(ev.workflows.greedy, "ctx", None), "reward", None) for _, _, ev in sets]
        callers = {id(c): c for c in [reward, *owned] if c is not None}  # each closed once

        async def score(urls):
            try:
                async with RolloutClient(urls, cfg.rollout.api_key) as client:
                    return [(name, sub, await evaluate(client, ev.samples, ev.workflows)) for name, sub, ev in sets]
            finally:
                for caller in callers.values():
                    await caller.aclose()  # the rewards' threads / worker processes / HTTP sessions
                for _, _, ev in sets:
                    await close_envs(ev.workflows.greedy, ev.workflows.sampled)

        urls = stack.enter_context(local_servers(cfg, model_dir, log_dir))
        prompts = ", ".join(f"{name + ': ' if name else ''}{len(ev.samples)} prompts" for name, _, ev in sets)
        print(f"[{PROG}] {len(urls)} server(s) on {model_dir}; {prompts}", flush=True)
        return asyncio.run(score(urls))


# ----------------------------------------------------------------------------- results

def summarize(cfg, scored: list, ckpt: str, wall_s: float) -> dict:
    """results.json: what was scored, on what, and the numbers (the eval/* names of training's
    metrics.jsonl too, so a run's evaluation and this one compare key by key). One held-out set
    (data.eval_path): its numbers at the top level; several (data.eval_sets): each under
    sets.<name>, and the metrics under eval/<name>/..."""
    from megarl.rollout.evaluation import PeriodicEval

    head = {"model": ckpt or os.path.abspath(cfg.model.hf_path), "source": "checkpoint" if ckpt else "hf"}
    per_set, metrics = {}, {}
    for name, task, res in scored:
        m = PeriodicEval.metrics(res, step=0, version=0)
        for key in ("eval/version", "eval/step"):  # no training step or policy version here
            m.pop(key)
        r = task.rollout
        one = {"eval_path": os.path.abspath(task.data.eval_path), "reward_fn": r.eval_reward_fn or r.reward_fn,
               "workflow": r.workflow, "prompts": res.n, "greedy_accuracy": res.accuracy,
               "mean_reward": res.mean_reward}
        if res.pass_at_k is not None:
            n = max(cfg.eval.n, res.k)
            one.update({"k": res.k, "n": n, f"pass@{res.k}": res.pass_at_k, "pass@1": res.pass_at_1,
                        "mean_reward_sampled": res.mean_reward_at_k, "temperature": r.temperature})
        if not name:
            return {**head, **one, "wall_s": round(wall_s, 3), "metrics": m}
        per_set[name] = one
        metrics.update({f"eval/{name}/{'accuracy' if k == 'eval_accuracy' else k.removeprefix('eval/')}": v
                        for k, v in m.items() if k != "eval/greedy_pass@1"})
    return {**head, "sets": per_set, "wall_s": round(wall_s, 3), "metrics": metrics}


def summary_line(results: dict, out_dir: str) -> str:
    def one(r: dict) -> str:
        k = r.get("k")
        sampled = f", pass@1 {r['pass@1']:.4f}, pass@{k} {r[f'pass@{k}']:.4f} (n={r['n']})" if k else ""
        return (f"{r['eval_path']} ({r['prompts']} prompts): greedy accuracy {r['greedy_accuracy']:.4f}, "
                f"mean reward {r['mean_reward']:.4f}{sampled}")

    if "sets" in results:
        body = "; ".join(f"{name} on {one(r)}" for name, r in results["sets"].items())
    else:
        body = f"on {one(results)}"
    return f"{PROG}: {results['source']} {results['model']} {body}; {results['wall_s']:.1f} s -> {out_dir}/results.json"


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one


def write_outputs(out_dir: str, results: dict, rows) -> None:
    os.makedirs(out_dir, exist_ok=True)
    _write_atomic(os.path.join(out_dir, "samples.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
    _write_atomic(os.path.join(out_dir, "results.json"), json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
