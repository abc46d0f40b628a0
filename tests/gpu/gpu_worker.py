"""One-rank worker of the GPU tier (a fresh process per call: Megatron's parallel state is per
process). Prints one JSON line of measured numbers; the tests in this folder assert on them.

    gpu_worker.py train HF DTYPE SPEC STEPS     bf16/fp32 training steps on a fixed batch
    gpu_worker.py specs HF DTYPE                per-token logprobs, TE spec vs local spec
    gpu_worker.py push HF SERVER_URL TRANSPORT DTYPE
                                                push HF's weights into a running megarl-server,
                                                then compare its logprobs with the trainer's

It runs on CPU too (fp32, gloo), which is how its logic is checked on machines without a GPU;
the tests call it only when CUDA is present.
"""
import json
import os
import sys
import urllib.request

import torch

from megarl.common import compat
from megarl.trainer import parallel
from megarl.config import load_config
from megarl.launch.preflight import check_wire
from megarl.trainer.parallel import destroy_model_parallel_only
from megarl.trainer.batch import TensorBatch
from megarl.trainer.engine import Engine, EngineSpec
from megarl.trainer.sft import sft_loss

PROMPT = [1, 5, 9, 17, 33]


def counting_batch(n: int = 8, length: int = 24) -> TensorBatch:
    """Rows s, s+1, s+2, ... (mod 100, offset 10): the next token is learnable from the current
    one, so a few optimizer steps lower the loss well below its random-init value ln(128)."""
    rows = [[10 + (s * 11 + i) % 100 for i in range(length)] for s in range(n)]
    return TensorBatch.from_lists(rows, {"loss_mask": [[0.0] + [1.0] * (length - 1) for _ in rows]})


def config(hf: str, *overrides: str):
    return load_config(None, [f"model.hf_path={hf}", "data.train_path=unused", *overrides])


def train(hf: str, dtype: str, spec: str, steps: str) -> dict:
    cfg = config(hf, f"model.dtype={dtype}", f"model.spec={spec}", "optim.lr=3e-3",
                 "optim.lr_warmup_steps=0", "optim.clip_grad=1.0", f"train.steps={steps}")
    engine = Engine.build(EngineSpec.from_config(cfg), parallel.init_model_parallel(1, 1))
    batch = counting_batch()
    losses, norms = [], []
    for _ in range(int(steps)):
        m = engine.train_batch(batch, sft_loss)
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    p = next(engine.chunks[0].parameters())
    return {"losses": losses, "grad_norms": norms, "param_dtype": str(p.dtype), "device": str(p.device),
            "use_te": engine.use_te}


def specs(hf: str, dtype: str) -> dict:
    """Same HF weights under the TE and the local layer spec: per-token logprob differences over
    the predicted positions (entry 0 of each row is 0.0 in both by definition)."""
    batch = counting_batch(6, 20)
    out, experts = {}, {}  # experts: the MoE expert module of each spec (None: dense)
    for spec in ("te", "local"):
        cfg = config(hf, f"model.spec={spec}", f"model.dtype={dtype}")
        engine = Engine.build(EngineSpec.from_config(cfg), parallel.init_model_parallel(1, 1), trainable=False)
        out[spec] = engine.compute_logp(batch).logp[:, 1:].float().cpu()
        mlp = engine.chunks[0].decoder.layers[0].mlp
        experts[spec] = type(mlp.experts).__name__ if hasattr(mlp, "experts") else None
        destroy_model_parallel_only()
    diff = (out["te"] - out["local"]).abs()
    return {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()), "tokens": diff.numel(),
            "experts": experts}


def generate(server: str, n: int = 16) -> tuple[list[int], list[float], str]:
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    req = urllib.request.Request(server + "/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        meta = json.loads(r.read())["meta_info"]
    lps = meta["output_token_logprobs"]
    return PROMPT + [t for _, t, _ in lps], [lp for lp, _, _ in lps], str(meta["weight_version"])


def gap(engine: Engine, ids: list[int], server_lps: list[float]) -> tuple[float, float]:
    """max and mean |trainer logprob - server logprob| over the generated tokens."""
    logp = engine.compute_logp(TensorBatch.from_lists([ids])).logp[0].float().cpu()
    mine = logp[len(PROMPT):len(ids)]
    d = (mine - torch.tensor(server_lps)).abs()
    return float(d.max()), float(d.mean())


def push(hf: str, server: str, transport: str, dtype: str) -> dict:
    from megarl.rollout.cluster import RolloutCluster
    from megarl.weights.push import PushSpec, WeightPusher

    work = os.path.dirname(os.path.abspath(hf))
    cfg = config(hf, f"model.dtype={dtype}", f"weights.transport={transport}", "weights.timeout_s=120",
                 f"rollout.servers=[{server}]", f"train.run_dir={work}/run",
                 f"weights.disk_dir={work}/push_disk")
    check_wire(cfg)  # the wire the server advertises, as megarl-train's preflight chooses it
    ps = parallel.init_model_parallel(1, 1)
    engine = Engine.build(EngineSpec.from_config(cfg), ps, trainable=False)
    ids0, lps0, _ = generate(server)  # the server still holds its own (other) weights
    before = gap(engine, ids0, lps0)
    cluster = RolloutCluster.from_config(cfg, [server], driver=True)
    pusher = WeightPusher(PushSpec.from_config(cfg), engine, cluster)
    metrics = pusher.push()
    backend = getattr(pusher.transport, "backend", None)
    pusher.close()
    cluster.close()
    ids1, lps1, version = generate(server)
    after = gap(engine, ids1, lps1)
    return {"before_max": before[0], "before_mean": before[1], "after_max": after[0],
            "after_mean": after[1], "server_version": version, "pushed_version": metrics.version,
            "backend": backend, "trainer_device": str(ps.device)}


def main():
    compat.quiet_megatron_warnings()
    cmd, args = sys.argv[1], sys.argv[2:]
    parallel.init_distributed()
    result = {"train": train, "specs": specs, "push": push}[cmd](*args)
    print(json.dumps(result), flush=True)
    os._exit(0)  # an update group's sockets may linger; do not wait on them


if __name__ == "__main__":
    main()
