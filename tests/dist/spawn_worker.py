"""Rank body for test_spawn.py, started by megarl.launch.spawn.run_ranks (not torchrun):
    python -m spawn_worker OUT MODE
Meets the other ranks through megarl.trainer.parallel.init_distributed, all-reduces its rank, writes
{rank, sum, listening sockets of this process, env} to OUT/rank<R>.json, then by MODE:
"ok" exits 0; "fail" rank 1 exits 3 while rank 0 hangs (as in a collective that never notices);
"signal" every rank waits for SIGTERM, writes OUT/term<R> and exits 0."""
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "e2e"))
from test_listeners import listening, socket_inodes  # noqa: E402

from megarl.trainer import parallel  # noqa: E402


def main(out: str, mode: str) -> int:
    info = parallel.init_distributed("gloo")
    total = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(total)
    table = listening()
    mine = sorted(table[i] for i in socket_inodes(os.getpid()) if i in table)
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
    with open(os.path.join(out, f"rank{info.rank}.json"), "w") as f:
        json.dump({"rank": info.rank, "sum": total.item(), "listening": mine,
                   "env": {k: os.environ.get(k) for k in keys}}, f)
    dist.barrier()
    if mode == "fail":
        if info.rank == 1:
            return 3
        time.sleep(300)
    if mode == "signal":
        def on_term(_signum, _frame):
            open(os.path.join(out, f"term{info.rank}"), "a").write("x")
            os._exit(0)
        signal.signal(signal.SIGTERM, on_term)
        open(os.path.join(out, f"ready{info.rank}"), "w").close()
        time.sleep(120)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
