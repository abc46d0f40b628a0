import sys

from megarl.envs.server import main

sys.exit(main())
