"""GPU tier of the colocated placement (issue #31 item 5), skipped without CUDA:

- sleep and wake of a megarl-server on the GPU: releasing its weights and KV cache gives the
  device memory back (`torch.cuda.mem_get_info`, device-wide, seen from this process), and after
  the wake and a weight load its greedy output is the one from before;
- the CUDA-IPC handover SGLang reads (`megarl.protocol.tensor_wire.encode_sglang_ipc`, what a
  colocated push to SGLang on the trainer's GPU sends): another process opens the handles and sees
  the trainer's tensors bit for bit, and writes the trainer makes after the call are visible to it
  (shared memory, not a copy);
- a colocated megarl-train run on the GPU with its megarl-server there (shared-memory handover).
"""
import base64
import json
import os
import subprocess
import sys
import time
import urllib.request

import torch
from gpu_support import REPO, Server, child_env, requires_cuda

pytestmark = requires_cuda


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def greedy(url: str) -> list:
    return post(url + "/generate", {"input_ids": list(range(3, 40)), "sampling_params": {
        "temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}})["output_ids"]


def test_sleep_gives_the_gpu_memory_back(tmp_path, record_property):
    from megarl.models.random_hf import tiny_config, write_random_hf

    hf = write_random_hf(str(tmp_path / "hf"), tiny_config(hidden_size=1024, intermediate_size=4096,
                                                           vocab_size=4096, num_attention_heads=16,
                                                           num_key_value_heads=16))
    server = Server(hf, "--device", "cuda", "--max-running-requests", "64", "--context-length", "256")
    server.wait_ready()
    try:
        before = greedy(server.url)
        free0, _ = torch.cuda.mem_get_info()
        out = post(server.url + "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})
        time.sleep(0.5)
        free1, _ = torch.cuda.mem_get_info()
        record_property("gpu_memory_released", json.dumps({"freed_bytes": out["freed_bytes"],
                                                           "device_free_gain": free1 - free0}))
        assert free1 - free0 >= 0.9 * out["freed_bytes"] > 0, (free0, free1, out)
        post(server.url + "/resume_memory_occupation", {"tags": ["kv_cache", "weights"]})
        assert post(server.url + "/update_weights_from_disk", {"model_path": hf})["success"]
        assert greedy(server.url) == before
    finally:
        server.stop()


def test_cuda_ipc_handover_is_the_trainers_memory():
    from megarl.protocol.tensor_wire import encode_sglang_ipc

    tensors = {"a": torch.randn(1000, 1000, device="cuda"), "b": torch.arange(10, device="cuda").float()}
    payload = encode_sglang_ipc(tensors)
    assert len(base64.b64decode(payload)) < 10_000  # handles, not the 4 MB of weights
    code = ("import base64, pickle, sys, torch\n"
            "named = pickle.loads(base64.b64decode(sys.argv[1]))\n"
            "print({k: float(v.double().sum()) for k, v in named})\n")
    torch.cuda.synchronize()
    out = subprocess.run([sys.executable, "-c", code, payload], capture_output=True, text=True,
                         timeout=120, env=child_env())
    assert out.returncode == 0, out.stderr[-3000:]
    got = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 - our own child's dict of floats
    assert abs(got["a"] - float(tensors["a"].double().sum())) < 1e-6
    assert got["b"] == 45.0


def test_colocated_run_on_gpu(tmp_path, record_property):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megarl.train", os.path.join(REPO, "configs", "tiny_grpo.yaml"),
           f"model.hf_path={REPO}/examples/tiny/model", f"train.run_dir={run}", "checkpoint.hf_export_dir=",
           f"data.train_path={REPO}/examples/tiny/data/rl_prompts.jsonl", "data.eval_path=",
           "train.steps=10", "rollout.placement=colocated", "rollout.max_staleness=0",
           "weights.transport=shm", "rollout.server_args=[--device,cuda]", "--debug"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=str(tmp_path), env=child_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    record_property("colocated_gpu", json.dumps({r["step"]: r.get("mismatch/mean") for r in rows}))
    assert rows[0]["mismatch/onpolicy_frac"] == 1.0
    assert all(r["staleness_max"] == 0 for r in rows)
