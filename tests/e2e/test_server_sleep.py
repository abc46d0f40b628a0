"""Sleep and wake on a real megarl-server process (SGLang's /release_memory_occupation and
/resume_memory_occupation): the resident memory (/proc/PID/status VmRSS) falls by at least the KV
cache on a kv_cache release and by at least the weights on a weights release; while asleep
nothing is generated (a request queues) and a busy server refuses to sleep; after the wake and a
weight load the greedy output is the one from before.

The model is a random Llama big enough for the memory to show (14.7 M parameters, 59 MB fp32;
KV cache 16 slots x 512 positions x 4 layers, 134 MB once grown)."""
from __future__ import annotations

import concurrent.futures
import os
import time

import pytest
from e2e_servers import ServerProc, http

from megarl.models.random_hf import tiny_config, write_random_hf

PROMPT = list(range(3, 103))


def rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def greedy(url: str, n: int = 24, prompt=PROMPT):
    status, out = http("POST", url + "/generate", {"input_ids": prompt, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}}, timeout=120)
    assert status == 200, out
    return out["output_ids"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    hf = write_random_hf(str(tmp_path_factory.mktemp("sleepy")), tiny_config(
        hidden_size=512, intermediate_size=1536, vocab_size=1024, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=512))
    s = ServerProc(hf, "--max-running-requests", "16", "--context-length", "512", "--threads", "1")
    s.wait_ready()
    s.hf = hf
    yield s
    s.stop()


def test_sleep_frees_the_kv_cache_and_the_weights_and_wake_gives_the_same_output(server):
    url, pid = server.url, server.proc.pid
    before = greedy(url)
    # grow the cache to its full size: 16 requests at once, 100 + 300 tokens each
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: greedy(url, 300, [3 + i] + PROMPT), range(16)))
    time.sleep(0.5)
    full = rss(pid)

    status, out = http("POST", url + "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert status == 200 and out["success"], out
    kv = out["freed_bytes"]
    assert kv >= 16 * 8 * 512 * 64 * 4 * 2 * 4  # slots x heads x positions x head_dim x fp32 x K,V x layers
    no_kv = rss(pid)
    assert full - no_kv >= kv, (full, no_kv, kv)

    status, out = http("POST", url + "/release_memory_occupation", {"tags": ["weights"]})
    assert status == 200, out
    weights = out["freed_bytes"]
    assert weights >= 14_000_000 * 4
    asleep = rss(pid)
    assert no_kv - asleep >= 0.9 * weights, (no_kv, asleep, weights)
    print(f"RSS {full / 2**20:.0f} MB -> {no_kv / 2**20:.0f} MB without the KV cache "
          f"({kv / 2**20:.0f} MB) -> {asleep / 2**20:.0f} MB without the weights ({weights / 2**20:.0f} MB)")
    info = http("GET", url + "/get_server_info")[1]
    assert info["memory_released"] == ["kv_cache", "weights"]

    # asleep: a request waits; released twice is an error naming the tag
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(greedy, url)
        time.sleep(1.0)
        assert not waiting.done()
        status, out = http("POST", url + "/release_memory_occupation", {"tags": ["weights"]})
        assert status == 400 and "already released" in out["message"], out
        # wake: memory back, but the weights are zeros until a load writes every parameter
        status, out = http("POST", url + "/resume_memory_occupation", {})
        assert status == 400 and "not released" in out["message"]  # cuda_graph was never released
        status, out = http("POST", url + "/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})
        assert status == 200 and out["awaiting_weights"] > 0, out
        time.sleep(0.5)
        assert not waiting.done()
        status, out = http("POST", url + "/update_weights_from_disk", {"model_path": server.hf})
        assert status == 200 and out["success"], out
        assert waiting.result(timeout=60) == before
    assert greedy(url) == before
    assert http("GET", url + "/get_server_info")[1]["awaiting_weights"] == 0


def test_a_busy_server_refuses_to_sleep_and_bad_tags_are_named(server):
    url = server.url
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(greedy, url, 400)
        time.sleep(0.3)
        status, out = http("POST", url + "/release_memory_occupation", {"tags": ["kv_cache"]})
        busy.result(timeout=120)
    assert status == 400 and "idle" in out["message"], out
    status, out = http("POST", url + "/release_memory_occupation", {"tags": ["gpu"]})
    assert status == 400 and "tags: unknown ['gpu']" in out["message"], out
    assert os.path.exists(f"/proc/{server.proc.pid}")  # still serving
