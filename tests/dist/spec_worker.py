"""torchrun worker (2 ranks, TP=2): the trainer's components built from hand-made specs, no
`Config` anywhere - an `Engine` and a `Critic` from `EngineSpec`/`CriticSpec` over their own
sections, a `WeightPusher` from a `PushSpec`, pushing into a real megarl-server. Rank 0 writes
what it measured to the JSON file named by argv[3]."""
import json
import sys
import urllib.request

import torch
import torch.distributed as dist

from megarl.common import compat
from megarl.trainer import parallel
from megarl.algo.config import AlgoConfig
from megarl.config import CriticConfig, ModelConfig, OptimConfig, ParallelConfig, WeightSyncConfig
from megarl.config.moe import MoEConfig
from megarl.rollout.cluster import RolloutCluster
from megarl.trainer.batch import TensorBatch
from megarl.trainer.critic import Critic, CriticSpec
from megarl.trainer.engine import Engine, EngineSpec
from megarl.protocol.wire_plan import WirePlan
from megarl.weights.push import PushSpec, WeightPusher

PROMPT = [1, 5, 9, 17, 33]


def server_logprobs(server: str) -> tuple[list[int], list[float]]:
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
    req = urllib.request.Request(f"{server}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        lps = json.loads(r.read())["meta_info"]["output_token_logprobs"]
    return PROMPT + [t for _, t, _ in lps], [lp for lp, _, _ in lps]


def gap(engine, server: str, ps) -> tuple[float, list[int]]:
    """Max |trainer - server| logprob over the server's greedy continuation of PROMPT."""
    box = [server_logprobs(server) if ps.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    ids, server_lp = box[0]
    mine = engine.compute_logp(TensorBatch.from_lists([ids])).logp[0, len(PROMPT):]
    return float((mine - torch.tensor(server_lp)).abs().max()), ids


def main(hf: str, server: str, out: str) -> None:
    compat.quiet_megatron_warnings()
    parallel.init_distributed()
    ps = parallel.init_model_parallel(2, 1)
    spec = EngineSpec(ModelConfig(hf_path=hf), ParallelConfig(tp=2), OptimConfig(lr=1e-3), MoEConfig(),
                      steps=4, micro_batch_tokens=256)
    engine = Engine.build(spec, ps)
    weights = WeightSyncConfig(transport="distributed", tensor_format="megarl", bucket_mb=1, timeout_s=60.0,
                               verify_interval=1, pause_mode="abort")
    pusher = WeightPusher(PushSpec(weights, "/unused-run-dir", WirePlan.decide(weights)),
                          engine, RolloutCluster([server], driver=ps.rank == 0, timeout_s=60.0))
    gap_before, _ = gap(engine, server, ps)
    pushed = pusher.push()
    mismatches = pusher.verify()
    gap_after, ids = gap(engine, server, ps)

    critic = Critic.build(CriticSpec(CriticConfig(value_clip=0.2), spec, AlgoConfig().build(),
                                     ppo_mini_batch_size=1, ppo_epochs=1, seed=0), ps)
    values = critic.values(TensorBatch.from_lists([ids, ids[:7]]))
    pusher.close()
    if ps.rank == 0:
        with open(out, "w") as f:
            json.dump({"version": pushed.version, "bytes": pushed.bytes, "mismatches": mismatches,
                       "gap_before": gap_before, "gap_after": gap_after, "values_shape": list(values.shape),
                       "values_finite": bool(torch.isfinite(values).all()),
                       "value_pad": float(values[1, 7:].abs().max())}, f)
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:4])
