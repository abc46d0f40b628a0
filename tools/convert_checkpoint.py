"""HF <-> Megatron dist-checkpoint conversion; the same tool as the `megarl-convert` console script.

    python tools/convert_checkpoint.py hf-to-mcore --hf HF_DIR --out CKPT_DIR [--tp N --pp M]
    python tools/convert_checkpoint.py mcore-to-hf --ckpt CKPT_OR_SAVE_DIR --out HF_DIR [--dtype D]
"""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, REPO)
    # ranks started by the tool (torchrun -m megarl...) must find the package too
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))

from megarl.commands.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
