"""megarl: Megatron-native asynchronous RL post-training (README.md, docs/architecture.md)."""
from megarl.common import megatron_import as _megatron_import

_megatron_import.install()  # megatron.core's first import without torch._dynamo and wandb (megarl/common/megatron_import.py)
