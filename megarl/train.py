"""megarl-train CONFIG.yaml [a.b=c ...] -- the main job.

    init ranks -> build engine (Megatron model, DDP, optimizer) -> resume -> loop:
        SFT: next batch -> train step -> log -> maybe save / export
        RL:  connect rollout cluster -> push weights -> loop {next rollout batch -> PPO update ->
             push weights -> log -> maybe save / export}

Run it directly and it starts its own ranks (torchrun on loopback) when the config needs more
than one; under torchrun, srun or mpirun it joins the job it is in.
"""
from __future__ import annotations

import sys

from megarl import compat, parallel
from megarl.config import ConfigError, load_config, save_config


CONSOLE_KEYS = {
    "sft": ["loss", "grad_norm", "lr", "step_time"],
    "grpo": ["reward", "eval_accuracy", "loss", "staleness_max", "trainer_idle_ratio",
             "rollout_idle_ratio", "step_time"],
}


def parse_args(argv: list[str]) -> tuple[str, list[str]]:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    return argv[0], argv[1:]


def run_sft(cfg, ps, engine, logger, ckpt) -> None:
    from megarl.checkpoint import maybe_export_hf
    from megarl.metrics import progress
    from megarl.trainer.sft import SFTData, sft_loss

    data = SFTData(cfg, ps)
    ckpt.register("data", data)
    start = ckpt.resume()
    for step in progress(range(start + 1, cfg.train.steps + 1), desc="sft", total=cfg.train.steps - start):
        metrics = engine.train_batch(data.next_batch(), sft_loss)
        logger.log(metrics, step)
        ckpt.maybe_save(step, last=step == cfg.train.steps)
        maybe_export_hf(cfg, engine, step, last=step == cfg.train.steps)


def main(argv: list[str] | None = None) -> int:
    path, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(path, overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"megarl-train: {e}", file=sys.stderr)
        return 2
    nproc = cfg.parallel.world_size or cfg.parallel.tp * cfg.parallel.pp
    if nproc > 1 and not parallel.under_launcher():
        return parallel.relaunch(nproc, "megarl.train", [path, *overrides])

    compat.quiet_megatron_warnings()
    if cfg.train.torch_threads:
        import torch
        torch.set_num_threads(cfg.train.torch_threads)
    from megarl.checkpoint import CheckpointManager
    from megarl.metrics import MetricsLogger
    from megarl.trainer.engine import Engine

    info = parallel.init_distributed(cfg.parallel.backend)
    try:
        from megarl.config import check_world_size
        check_world_size(cfg, info.world_size)
    except ConfigError as e:
        print(f"megarl-train: {e}", file=sys.stderr)
        return 2
    ps = parallel.init_model_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp, cfg.model.seed)
    if ps.rank == 0:
        save_config(cfg, cfg.train.run_dir)
    engine = Engine.build(cfg, ps)
    ckpt = CheckpointManager(cfg, ps, engine)
    logger = MetricsLogger(cfg.train.run_dir, tensorboard=cfg.logging.tensorboard,
                           wandb_project=cfg.logging.wandb_project or None,
                           console_keys=CONSOLE_KEYS[cfg.train.algorithm],
                           console_interval=cfg.logging.log_interval)
    if cfg.train.algorithm == "sft":
        run_sft(cfg, ps, engine, logger, ckpt)
    else:
        from megarl.trainer.rl import run_rl
        run_rl(cfg, ps, engine, logger, ckpt)
    logger.close()
    if cfg.train.algorithm != "sft" and ps.rank == 0:
        from megarl.plotting import write_learning_curve
        png = write_learning_curve(cfg.train.run_dir)  # None (with a note) without matplotlib
        if png:
            print(f"[grpo] learning curve: {png}", flush=True)
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
