"""torchrun worker (2 ranks) for test_checkpoint.py: SFT on a tiny random Llama with checkpoints.

    ckpt_worker.py WORK train    reference run (TP=1 x DP=2, distributed optimizer, 6 steps, saves
                                 at 3 and 6, writes WORK/ref.json), then a second run in WORK/crash
                                 killed (os._exit) while saving step 6, after the tensors are written
    ckpt_worker.py WORK async_kill  an async-save run (checkpoint.async_save) killed (os._exit) in its
                                 writer thread while saving step 6, after the tensors are written
    ckpt_worker.py WORK resume   A: resume WORK/crash (must pick step 3) and run to 6; B: TP=2 from
                                 the reference's TP=1 step-3 checkpoint; C: PP=2 without the
                                 distributed optimizer, save + reload in-process; D: CP=2 (DP=1) from
                                 the reference's CP=1 x DP=2 step-3 checkpoint, saving step 6; E: CP=1
                                 x DP=2 loads D's CP=2 step 6 and exports at once; G: resume the async
                                 crash (must pick step 3) and run to 6. Writes WORK/resume.json.
In ``train`` an async-save run (saves at 3 and 6 in the background) also runs after the reference.
Each phase exports the final model as HF safetensors (WORK/<phase>_hf) for bitwise comparison.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

from megarl.common import compat
from megarl.trainer import parallel
from megarl.checkpoint import CheckpointManager
from megarl.config import load_config
from megarl.trainer.engine import Engine, EngineSpec
from megarl.trainer.sft import SFTData, sft_loss

STEPS = 6


def make_cfg(work, save_dir, tp, dist_opt, keep_last=2, pp=1, cp=1, async_save=False):
    return load_config(None, [
        f"model.hf_path={work}/hf", "model.init=random", f"data.train_path={work}/sft.jsonl",
        f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.cp={cp}", f"parallel.distributed_optimizer={str(dist_opt).lower()}",
        f"train.steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_tokens=64",
        "train.max_seq_len=32", f"train.run_dir={work}/run", "optim.lr=3e-3", "optim.min_lr=3e-4",
        "optim.lr_warmup_steps=2", "optim.lr_decay_style=cosine",
        f"checkpoint.save_dir={save_dir}", "checkpoint.save_interval=3",
        f"checkpoint.keep_last={keep_last}", f"checkpoint.async_save={str(async_save).lower()}"])


def setup(cfg):
    ps = parallel.init_model_parallel(cfg.parallel.tp, cfg.parallel.pp, seed=cfg.model.seed, cp=cfg.parallel.cp)
    engine = Engine.build(EngineSpec.from_config(cfg), ps)
    data = SFTData(cfg, ps)
    ckpt = CheckpointManager(cfg, ps, engine)
    ckpt.register("data", data)
    return ps, engine, data, ckpt


def train(engine, data, ckpt, start, hf_out=None):
    losses = {}
    for step in range(start + 1, STEPS + 1):
        losses[step] = engine.train_batch(data.next_batch(), sft_loss)["loss"]
        ckpt.maybe_save(step, last=step == STEPS, policy_version=100 + step)
    if hf_out:
        engine.export_hf(hf_out)
    parallel.destroy_model_parallel_only()
    return losses


def write(path, obj):
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)
    dist.barrier()


def run_train(work):
    _, engine, data, ckpt = setup(make_cfg(work, f"{work}/ref", tp=1, dist_opt=True))
    write(f"{work}/ref.json", {"losses": train(engine, data, ckpt, 0, f"{work}/ref_hf")})
    # the same run saving in the background
    _, engine, data, ckpt = setup(make_cfg(work, f"{work}/async", tp=1, dist_opt=True, async_save=True))
    write(f"{work}/async.json", {"losses": train(engine, data, ckpt, 0, f"{work}/async_hf"),
                                 "last_save_s": ckpt.last_save_s})

    _, engine, data, ckpt = setup(make_cfg(work, f"{work}/crash", tp=1, dist_opt=True, keep_last=1))

    def kill(stage, step):
        if stage == "written" and step == 6:
            open(f"{work}/killed_rank{dist.get_rank()}", "w").close()
            os._exit(17)

    ckpt.fault_hook = kill
    train(engine, data, ckpt, 0)


def run_async_kill(work):
    _, engine, data, ckpt = setup(make_cfg(work, f"{work}/async_crash", tp=1, dist_opt=True, keep_last=1,
                                           async_save=True))
    import threading

    def kill(stage, step):
        if stage == "written" and step == 6:
            assert threading.current_thread() is not threading.main_thread()  # in the writer
            open(f"{work}/async_killed_rank{dist.get_rank()}", "w").close()
            os._exit(17)

    ckpt.fault_hook = kill
    train(engine, data, ckpt, 0)


def run_resume(work):
    results = {}
    if dist.get_rank() == 0:  # a directory named like a checkpoint but never completed
        os.makedirs(f"{work}/crash/step_00000009", exist_ok=True)
        open(f"{work}/crash/step_00000009/metadata.json", "w").write("{}")
    dist.barrier()
    # A: same layout, automatic resume from the save dir the crash left behind
    _, engine, data, ckpt = setup(make_cfg(work, f"{work}/crash", tp=1, dist_opt=True, keep_last=1))
    start = ckpt.resume()
    results["A"] = {"start": start, "from": ckpt.loaded_from, "policy_version": ckpt.policy_version,
                    "engine_step": engine.step, "sampler": data.state_dict()["sampler"]}
    results["A"]["losses"] = train(engine, data, ckpt, start, f"{work}/A_hf")
    # B: TP=2 (DP=1) from the TP=1 x DP=2 reference checkpoint at step 3
    _, engine, data, ckpt = setup(make_cfg(work, f"{work}/B", tp=2, dist_opt=True))
    start = ckpt.load(f"{work}/ref/step_00000003")
    results["B"] = {"start": start, "losses": train(engine, data, ckpt, start, f"{work}/B_hf")}
    # C: PP=2 without the distributed optimizer; save at 2, continue, reload, continue again
    cfg = make_cfg(work, f"{work}/C", tp=1, dist_opt=False, pp=2)
    _, engine, data, ckpt = setup(cfg)
    for _ in range(2):
        engine.train_batch(data.next_batch(), sft_loss)
    ckpt.save(2)
    ref = [engine.train_batch(data.next_batch(), sft_loss)["loss"] for _ in range(2)]
    ref_params = [p.detach().clone() for p in engine.chunks[0].parameters()]
    parallel.destroy_model_parallel_only()
    _, engine, data, ckpt = setup(cfg)
    start = ckpt.resume()
    got = [engine.train_batch(data.next_batch(), sft_loss)["loss"] for _ in range(2)]
    same = all(torch.equal(a, b) for a, b in zip(ref_params, engine.chunks[0].parameters()))
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, same)
    results["C"] = {"start": start, "ref": ref, "got": got, "params_equal": all(flags)}
    parallel.destroy_model_parallel_only()
    # D: CP=2 from the CP=1 reference's step 3; E: CP=1 x DP=2 loads D's CP=2 step 6
    _, engine, data, ckpt = setup(make_cfg(work, f"{work}/D", tp=1, dist_opt=True, cp=2))
    start = ckpt.load(f"{work}/ref/step_00000003")
    results["D"] = {"start": start, "losses": train(engine, data, ckpt, start, f"{work}/D_hf")}
    _, engine, data, ckpt = setup(make_cfg(work, f"{work}/E", tp=1, dist_opt=True))
    results["E"] = {"start": ckpt.load(f"{work}/D/step_00000006")}
    engine.export_hf(f"{work}/E_hf")
    parallel.destroy_model_parallel_only()
    # G: the async-save run killed while writing step 6 in the background resumes from step 3
    _, engine, data, ckpt = setup(make_cfg(work, f"{work}/async_crash", tp=1, dist_opt=True, keep_last=1,
                                           async_save=True))
    start = ckpt.resume()
    results["G"] = {"start": start, "from": ckpt.loaded_from}
    results["G"]["losses"] = train(engine, data, ckpt, start, f"{work}/G_hf")
    write(f"{work}/resume.json", results)


def main():
    work, mode = sys.argv[1], sys.argv[2]
    compat.quiet_megatron_warnings()
    torch.set_num_threads(1)
    parallel.init_distributed()
    {"train": run_train, "async_kill": run_async_kill, "resume": run_resume}[mode](work)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
