"""megarl-logprobs on sequences of one token (issue 40, a late line open two rounds: a file of
only such sequences was a shape-mismatch RuntimeError): entry 0 is 0.0 by the contract, so a
1-token sequence is [0.0] without a forward pass, beside longer ones as alone. The real entry
point on the tiny demo model."""
import json
import os
import subprocess
import sys

import harness


def logprobs(tmp_path, rows: list[list[int]]) -> list[dict]:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    proc = subprocess.run([sys.executable, "-m", "megarl.commands.logprobs", "--ckpt", str(harness.TINY / "model"),
                           "--input", str(src), "--output", str(out)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_one_token_sequences_alone_and_mixed(tmp_path):
    only = logprobs(tmp_path, [[5], [7]])
    assert [r["logprobs"] for r in only] == [[0.0], [0.0]]
    (tmp_path / "mixed").mkdir()
    mixed = logprobs(tmp_path / "mixed", [[5], [5, 6, 7], [9]])
    assert [len(r["logprobs"]) for r in mixed] == [1, 3, 1] and mixed[0]["logprobs"] == [0.0]
    assert mixed[1]["logprobs"][0] == 0.0 and all(lp < 0 for lp in mixed[1]["logprobs"][1:])
