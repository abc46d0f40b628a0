"""megarl-train CONFIG.yaml [a.b=c ...] -- the main job.

    init ranks -> build engine (Megatron model, DDP, optimizer) -> resume -> loop:
        SFT: next batch -> train step -> log -> maybe save / export
        RL:  connect rollout cluster -> push weights -> loop {next rollout batch -> PPO update ->
             push weights -> log -> maybe save / export}

Run it directly and it starts its own ranks (torchrun on loopback) when the config needs more
than one; under torchrun, srun or mpirun it joins the job it is in.

Bad input fails before any rank starts: the config (`load_config`), then what it points at
(`megarl.preflight`: model, tokenizer, data, plugins, run_dir, rollout servers), as one line
``megarl-train: <field>: <problem>`` and exit status 2; any later error is one line and exit
status 1. ``--debug`` (anywhere on the command line) shows the traceback instead.
"""
from __future__ import annotations

import sys

from megarl import compat, parallel
from megarl.cli import DEBUG_FLAG, pop_debug, run_main
from megarl.config import ConfigError, load_config, save_config

PROG = "megarl-train"


def parse_args(argv: list[str]) -> tuple[str, list[str]]:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0)
    if not argv or argv[0].startswith("-"):
        print(f"{PROG}: usage: {PROG} CONFIG.yaml [a.b=c ...] [--debug] (see --help)", file=sys.stderr)
        raise SystemExit(2)
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
    argv, debug = pop_debug(sys.argv[1:] if argv is None else argv)
    path, overrides = parse_args(argv)
    return run_main(PROG, lambda: train(path, overrides, debug), debug, expected=(ConfigError,), code=2)


def train(path: str, overrides: list[str], debug: bool = False) -> int:
    from megarl.preflight import check_inputs

    cfg = load_config(path, overrides)
    launched = parallel.under_launcher()
    check_inputs(cfg, cleanup_run_dir=not launched)
    nproc = cfg.parallel.world_size or cfg.parallel.tp * cfg.parallel.pp
    if nproc > 1 and not launched:
        return parallel.relaunch(nproc, "megarl.train", [path, *overrides] + ([DEBUG_FLAG] if debug else []))

    compat.quiet_megatron_warnings()
    from megarl.checkpoint import CheckpointManager
    from megarl.config import check_world_size
    from megarl.metrics import MetricsLogger
    from megarl.trainer.engine import Engine

    info = parallel.init_distributed(cfg.parallel.backend)
    check_world_size(cfg, info.world_size)
    ps = parallel.init_model_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp, cfg.model.seed)
    if ps.rank == 0:
        save_config(cfg, cfg.train.run_dir)
    engine = Engine.build(cfg, ps)
    ckpt = CheckpointManager(cfg, ps, engine)
    logger = MetricsLogger(cfg.train.run_dir, tensorboard=cfg.logging.tensorboard,
                           wandb_project=cfg.logging.wandb_project or None,
                           console_keys=["loss", "grad_norm", "lr", "step_time"])
    if cfg.train.algorithm == "sft":
        run_sft(cfg, ps, engine, logger, ckpt)
    else:
        from megarl.trainer.rl import run_rl
        run_rl(cfg, ps, engine, logger, ckpt)
    logger.close()
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
