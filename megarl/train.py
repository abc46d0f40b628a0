"""megarl-train CONFIG.yaml [a.b=c ...] -- the main job.

    init ranks -> build engine (Megatron model, DDP, optimizer) -> resume -> loop:
        SFT: next batch -> train step -> log -> maybe save / export
        RL:  connect rollout cluster -> push weights -> loop {next rollout batch -> PPO update ->
             push weights -> log -> maybe save / export}

Run it directly and it starts its own ranks (torchrun on loopback) when the config needs more
than one; under torchrun, srun or mpirun it joins the job it is in. SIGUSR1/SIGTERM/SIGINT make
every rank finish its step, save a checkpoint and exit 0 (megarl.common.signals); the next start resumes.

Bad input fails before any rank starts: the config (`load_config`), then what it points at
(`megarl.launch.preflight`: model, tokenizer, data, plugins, run_dir, rollout servers), as one line
``megarl-train: <field>: <problem>`` and exit status 2; any later error is one line and exit
status 1. ``--debug`` (anywhere on the command line) shows the traceback instead. Nothing imports
torch before the config has loaded: a bad config costs a fraction of a second, not torch's import
(nor do most of preflight's checks: model config, tokenizer, data, plugins, run_dir).
"""
from __future__ import annotations

import sys

from megarl.common.cli import DEBUG_FLAG, config_args, pop_debug, run_main
from megarl.config import ConfigError, load_config, save_config
from megarl.common.signals import StopRequest, clear_stop_marker, dump_stacks_on_sigusr2, write_stop_marker

PROG = "megarl-train"
CONSOLE_KEYS = {
    "sft": ["loss", "grad_norm", "lr", "step_time"],
    "rl": ["reward", "eval_accuracy", "loss", "staleness_max", "trainer_idle_ratio",
           "rollout_idle_ratio", "step_time"],
}


def run_sft(cfg, ps, engine, logger, ckpt, stop: StopRequest) -> None:
    from megarl.checkpoint import maybe_export_hf
    from megarl.trainer.metrics import progress
    from megarl.trainer.sft import SFTData, sft_loss

    data = SFTData(cfg, ps)
    ckpt.register("data", data)
    start = ckpt.resume()
    for step in progress(range(start + 1, cfg.train.steps + 1), desc="sft", total=cfg.train.steps - start):
        metrics = engine.train_batch(data.next_batch(), sft_loss)
        logger.log(metrics, step)
        # same condition on every rank, so should_stop's all-reduce runs on all ranks or none
        if step < cfg.train.steps and stop.should_stop():
            ckpt.save(step)
            break
        ckpt.maybe_save(step, last=step == cfg.train.steps)
        maybe_export_hf(cfg, engine, step, last=step == cfg.train.steps)


def main(argv: list[str] | None = None) -> int:
    argv, debug = pop_debug(sys.argv[1:] if argv is None else argv)
    path, overrides = config_args(PROG, __doc__, argv)
    return run_main(PROG, lambda: launch(path, overrides, debug), debug, expected=(ConfigError,), code=2)


def launch(path: str, overrides: list[str], debug: bool = False) -> int:
    """Config and inputs checked here, once, before any rank exists; then this process trains or
    starts its own ranks."""
    from megarl.launch.preflight import check_inputs
    from megarl.launch.ranks import under_launcher

    dump_stacks_on_sigusr2()  # kill -USR2: where this process is, without stopping it
    cfg = load_config(path, overrides)
    launched = under_launcher()
    check_inputs(cfg, cleanup_run_dir=not launched)
    from megarl.trainer import parallel  # torch and megatron-core's shim: only once the inputs are known good

    nproc = cfg.parallel.world_size or cfg.parallel.model_parallel
    if nproc > 1 and not launched:
        return parallel.relaunch(nproc, "megarl.train", [path, *overrides] + ([DEBUG_FLAG] if debug else []))
    with StopRequest() as stop:  # before the slow setup, so an early signal is not lost
        return train(cfg, stop)


def train(cfg, stop: StopRequest) -> int:
    from megarl.common import compat
    from megarl.trainer import parallel

    compat.quiet_megatron_warnings()
    if cfg.train.torch_threads:  # auto (None): the RL loop's split (megarl.trainer.threads)
        import torch
        torch.set_num_threads(cfg.train.torch_threads)
    from megarl.checkpoint import CheckpointManager
    from megarl.config import check_world_size
    from megarl.trainer.metrics import MetricsLogger
    from megarl.trainer.engine import Engine, EngineSpec
    from megarl.trainer.rollout_link import RolloutSide
    from megarl.trainer.threads import ThreadSplit

    ranks = parallel.discover_ranks()
    check_world_size(cfg, ranks.world_size)
    threads = ThreadSplit.for_run(cfg, ranks.rank, ranks.world_size)
    if threads is not None:  # train.torch_threads auto: the rank's own share until an update borrows
        import torch
        torch.set_num_threads(threads.own)
    side = RolloutSide(cfg) if cfg.train.is_rl else None
    if ranks.rank == 0:
        save_config(cfg, cfg.train.run_dir)  # the manager reads it
        if side is not None:  # and the weight wire it expects (megarl.protocol.wire_plan)
            from megarl.protocol.wire_plan import WirePlan
            wire = WirePlan.of_config(cfg)
            wire.save(cfg.train.run_dir)
            print(f"[megarl] weight wire: {wire.describe()}", flush=True)
        clear_stop_marker(cfg.train.run_dir)
        if side is not None:  # it loads and starts its servers while megatron-core imports and the engine builds
            side.launch()
    info = parallel.init_distributed(cfg.parallel.backend)
    if info.rank == 0:
        where = f"rendezvous {info.master_addr}:{info.master_port}" if info.master_port else "no rendezvous"
        print(f"[megarl] {info.world_size} rank(s) from {info.source}, {where}", flush=True)
    ps = parallel.init_model_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp, cfg.model.seed,
                                      ep=cfg.parallel.ep, cp=cfg.parallel.cp)
    if side is not None:
        side.start(ps)
    engine = Engine.build(EngineSpec.from_config(cfg), ps)
    ckpt = CheckpointManager(cfg, ps, engine)
    logger = MetricsLogger(cfg.train.run_dir, tensorboard=cfg.logging.tensorboard,
                           wandb_project=cfg.logging.wandb_project or None,
                           console_keys=CONSOLE_KEYS["rl" if cfg.train.is_rl else "sft"],
                           console_interval=cfg.logging.log_interval)
    if cfg.train.is_rl:
        from megarl.trainer.rl import run_rl
        run_rl(cfg, ps, engine, logger, ckpt, stop=stop, side=side, threads=threads)
    else:
        run_sft(cfg, ps, engine, logger, ckpt, stop)
    ckpt.close()  # a checkpoint still being written in the background (checkpoint.async_save) is committed
    logger.close()
    if cfg.train.is_rl and ps.rank == 0:
        from megarl.common.plotting import write_learning_curve
        png = write_learning_curve(cfg.train.run_dir)  # None (with a note) without matplotlib
        if png:
            print(f"[grpo] learning curve: {png}", flush=True)
    if stop.stopped and ps.rank == 0:
        print(f"[megarl] stopped by {stop.received}; checkpoint saved, rerun to resume", flush=True)
        write_stop_marker(cfg.train.run_dir, stop.received)
    parallel.destroy()
    # Everything is closed and saved; what is left is the interpreter's last garbage collection
    # over torch's, megatron-core's and matplotlib's objects (~1 s a rank). Frozen objects are
    # skipped by it (they are still released by reference counting).
    import gc
    gc.freeze()
    return 0


if __name__ == "__main__":
    sys.exit(main())
