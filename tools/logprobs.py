"""Per-token logprobs of token sequences under a checkpoint; the same tool as `megarl-logprobs`.

    python tools/logprobs.py --ckpt DIR --input IN.jsonl --output OUT.jsonl [--tp N --pp M]
"""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, REPO)
    # ranks started by the tool (torchrun -m megarl...) must find the package too
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))

from megarl.commands.logprobs import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
