"""torchrun worker (one rank) for test_client_protocol: the trainer-side WeightPusher pushes the
weights of HF dir B to one rollout server that holds A, once per transport, and records (JSON)
the server's greedy continuation with its logprobs and weight_version after each push, the wire
megarl-train's preflight chose from what the server advertises (weights.tensor_format auto), and,
where it checks them (megarl-server), what `WeightPusher.verify` found.

    pusher_worker.py SERVER_URL API_KEY HF_A HF_B WORK_DIR OUT_JSON
"""
import dataclasses
import json
import os
import sys
import urllib.request

import torch

from megarl.common import compat
from megarl.trainer import parallel
from megarl.config import load_config
from megarl.launch.preflight import check_wire
from megarl.trainer.engine import Engine, EngineSpec
from megarl.rollout.cluster import RolloutCluster
from megarl.weights.push import PushSpec, WeightPusher

PROMPT = [1, 5, 9, 17]


def post(url: str, key: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def main():
    server, key, hf_a, hf_b, work, out = sys.argv[1:]
    compat.quiet_megatron_warnings()
    torch.set_num_threads(1)
    parallel.init_distributed()
    ps = parallel.init_model_parallel(1, 1)
    results = {}
    for transport in ("distributed", "tensor", "disk"):
        post(server + "/update_weights_from_disk", key, {"model_path": hf_a, "weight_version": "0"})
        cfg = load_config(None, [f"model.hf_path={hf_b}", "data.train_path=x", f"weights.transport={transport}",
                                 "weights.timeout_s=60",
                                 "weights.bucket_mb=1", f"weights.disk_dir={work}/push_disk",
                                 f"rollout.servers=[{server}]", f"rollout.api_key={key}",
                                 f"train.run_dir={work}/run"])
        check_wire(cfg)
        if cfg.weights.verify_interval:  # auto checks every 10th push: check this one
            cfg.weights = dataclasses.replace(cfg.weights, verify_interval=1)
        cluster = RolloutCluster.from_config(cfg, [server], driver=True)
        engine = Engine.build(EngineSpec.from_config(cfg), ps, trainable=False)
        pusher = WeightPusher(PushSpec.from_config(cfg), engine, cluster)
        metrics = pusher.push()
        # checksums of what was sent (disk: gathered again) against the server's /weights_checksum
        checked = pusher.verify() if cfg.weights.verify_interval else None
        pusher.close()
        cluster.close()
        res = post(server + "/generate", key, {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {
            "temperature": 0, "max_new_tokens": 12, "ignore_eos": True}})
        lps = res["meta_info"]["output_token_logprobs"]
        results[transport] = {"ids": PROMPT + [t for _, t, _ in lps], "logprobs": [lp for lp, _, _ in lps],
                              "version": res["meta_info"]["weight_version"], "pushed": metrics.version,
                              "verify": checked, "wire": cfg.weights.tensor_format}
    with open(out, "w") as f:
        json.dump(results, f)
    os._exit(0)  # the update group's sockets may linger; don't wait on them


if __name__ == "__main__":
    main()
