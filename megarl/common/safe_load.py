"""Safe loading: a checkpoint is refused before any pickled object in it could run code.

torch DCP stores its index (``.metadata``) as a pickle, and Megatron's ``common.pt`` is a
``torch.save`` file; a checkpoint downloaded from elsewhere is untrusted input. So:
``.metadata`` is unpickled with an allow-list of torch checkpoint dataclasses, enums, dtypes and
``torch.Size``; ``common.pt`` must load with ``weights_only=True``; and a checkpoint whose index
lists any non-tensor (pickled) entry is refused outright, because DCP would unpickle it on load.
megarl never writes such entries: module ``_extra_state`` is not saved and megarl's own state is
JSON (megarl.json) and safetensors (RNG).
"""
from __future__ import annotations

import dataclasses
import enum
import os
import pickle
import warnings

import torch

from megarl.common.errors import CheckpointError

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                "torch.distributed.checkpoint.filesystem")
_ALLOWED_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                    ("collections", "OrderedDict"), ("pathlib", "PosixPath"),
                    ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                    ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch DCP ``.metadata``: its dataclasses, enums, torch.Size and dtypes only."""

    def find_class(self, module, name):
        # Resolve only names from modules we already trust to import; then admit an object only
        # by what it is (a dtype, a DCP dataclass or enum), never by name alone: a DCP module
        # also exposes functions, and a function reference is how a pickle runs code.
        known = module in _DCP_MODULES or module == "torch" or (module, name) in _ALLOWED_GLOBALS
        obj = super().find_class(module, name) if known else None
        if (module, name) in _ALLOWED_GLOBALS or (module == "torch" and isinstance(
                obj, (torch.dtype, torch.layout, torch.memory_format))):
            return obj
        if module in _DCP_MODULES and isinstance(obj, type) and (
                dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
            return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def read_dcp_metadata(ckpt_dir: str):
    """The torch DCP ``Metadata`` of a checkpoint, unpickled through the allow-list."""
    path = os.path.join(ckpt_dir, ".metadata")
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (not a torch_dist checkpoint)") from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure means "refuse"
        raise CheckpointError(f"{path}: refused or unreadable ({e})") from None


def check_safe(ckpt_dir: str) -> None:
    """Refuses a checkpoint that would make loading unpickle arbitrary objects."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = read_dcp_metadata(ckpt_dir)
    pickled = sorted(k for k, v in md.state_dict_metadata.items()
                     if not isinstance(v, TensorStorageMetadata))
    if pickled:
        raise CheckpointError(f"{ckpt_dir}: holds pickled objects ({pickled[0]}"
                              f"{f' and {len(pickled) - 1} more' if len(pickled) > 1 else ''}); "
                              "megarl loads tensors only")
    common = os.path.join(ckpt_dir, "common.pt")
    if os.path.exists(common):
        try:
            with warnings.catch_warnings():  # torch warns about the refused global; the error says it
                warnings.simplefilter("ignore")
                torch.load(common, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{common}: refused by weights_only loading ({e})") from None
