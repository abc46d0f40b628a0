"""``python -m megarl.envs``: the megarl-env command (`megarl.envs.server.main`)."""
import sys

from megarl.envs.server import main

sys.exit(main())
