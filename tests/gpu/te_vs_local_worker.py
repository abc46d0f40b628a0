"""Prints max |logp_TE - logp_local| for one batch on one GPU (used by test_gpu_engine.py)."""
import os
import random
import sys

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29731")

from megarl import parallel  # noqa: E402
from megarl.config import load_config  # noqa: E402
from megarl.parallel import destroy_model_parallel_only  # noqa: E402
from megarl.trainer.batch import TensorBatch  # noqa: E402
from megarl.trainer.engine import Engine  # noqa: E402


def main():
    hf = sys.argv[1]
    rng = random.Random(0)
    batch = TensorBatch.from_lists([[rng.randrange(128) for _ in range(rng.randint(8, 24))]
                                    for _ in range(6)])
    parallel.init_distributed()
    out = {}
    for spec in ("te", "local"):
        cfg = load_config(None, [f"model.hf_path={hf}", "data.train_path=x", f"model.spec={spec}"])
        ps = parallel.init_model_parallel(1, 1)
        out[spec] = Engine.build(cfg, ps, trainable=False).compute_logp(batch).logp
        destroy_model_parallel_only()
    print(float((out["te"] - out["local"]).abs().max()))  # both zero-padded alike


if __name__ == "__main__":
    main()
