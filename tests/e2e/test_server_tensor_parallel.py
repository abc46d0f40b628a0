"""megarl-server --tp 2 (two gloo ranks, heads and MLP columns split) against --tp 1 on the same
weights: greedy tokens equal and logprobs within 1e-5, with several requests batched at once (the
followers mirror prefill, decode and the cache moves of finishing requests); after a weight load
from disk both still agree and the TP server's gathered tensors and checksums equal the files.
A mixture-of-experts model is refused with a one-line error naming --tp."""
import concurrent.futures
import subprocess
import sys

import torch
from safetensors.torch import load_file

from e2e_servers import http
from megarl.models.random_hf import tiny_config, write_random_hf

PROMPTS = [[1, 5, 9, 17, 33], [3, 4], [7] * 20, [2, 8, 16, 32, 64, 100, 127]]


def generate(url):
    def one(i):
        code, out = http("POST", url + "/generate", {
            "input_ids": PROMPTS[i], "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 4 + 3 * i, "ignore_eos": True}})
        assert code == 200, out
        return out["meta_info"]["output_token_logprobs"]

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # batched on the server
        return list(pool.map(one, range(len(PROMPTS))))


def max_diff(a, b):
    assert [[t for _, t, _ in x] for x in a] == [[t for _, t, _ in x] for x in b]  # same greedy tokens
    return max(abs(p[0] - q[0]) for x, y in zip(a, b) for p, q in zip(x, y))


def test_tp2_server_equals_tp1(tmp_path, start_server):
    # one kv head for 4 query heads: at TP=2 both ranks hold (a replica of) it; Qwen3 has q/k norms
    a = write_random_hf(str(tmp_path / "a"), tiny_config("Qwen3ForCausalLM", num_key_value_heads=1), seed=1)
    b = write_random_hf(str(tmp_path / "b"), tiny_config("Qwen3ForCausalLM", num_key_value_heads=1), seed=2)
    one, two = start_server(a), start_server(a, "--tp", "2")
    assert max_diff(generate(one.url), generate(two.url)) <= 1e-5
    for s in (one, two):
        code, out = http("POST", s.url + "/update_weights_from_disk", {"model_path": b})
        assert code == 200 and out["success"], out
    after = generate(two.url)
    assert max_diff(generate(one.url), after) <= 1e-5
    ref = load_file(f"{b}/model.safetensors")
    names = sorted(ref)
    for name in names:  # each tensor gathered from both ranks equals the file bitwise
        code, got = http("POST", two.url + "/get_weights_by_name", {"name": name, "truncate_size": 10**6})
        assert code == 200 and torch.equal(torch.tensor(got), ref[name]), name
    sums = [http("POST", s.url + "/weights_checksum", {"names": names})[1]["checksums"] for s in (one, two)]
    assert sums[0] == sums[1] and len(sums[0]) == len(names)
    # a shard-refit announce naming a storage the server does not have is refused before any receive
    code, out = http("POST", two.url + "/update_weights_from_distributed", {
        "names": ["model.layers.9.mlp.gate_up"], "dtypes": ["float32"], "shapes": [[]],
        "load_format": "shard_refit", "refit_src_tp": 2,
        "refit_units": [["model.layers.9.mlp.gate_up", "gate_up", 0, 128, 0, "float32"]]})
    assert code == 400 and out["message"] == "refit_units: \"unknown shard-refit unit 'model.layers.9.mlp.gate_up'\""


def test_moe_server_refuses_tp(tmp_path):
    m = write_random_hf(str(tmp_path / "moe"), tiny_config("Qwen3MoeForCausalLM"), seed=1)
    p = subprocess.run([sys.executable, "-m", "megarl.server", "--model", m, "--tp", "2", "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("megarl-server: cannot load")
    assert "--tp 2: Qwen3MoeForCausalLM is a mixture-of-experts model" in p.stderr
