"""LoRA adapter pushes merged into megarl-server's weights.

A LoRA trainer (``lora.rank > 0``) pushes, besides any full tensors, HF/PEFT-named adapters
(``model.layers.L.self_attn.q_proj.lora_A.weight`` [r, in], ``...lora_B.weight`` [out, r]) and the
scale ``lora.scaling`` (= alpha / r, one float32) through the ordinary weight endpoints. The server
keeps the base weight W0 of every adapted module (the value it held before the first adapter,
replaced whenever a full tensor of that module arrives) and serves

    W = W0 + scaling * B A

recomputed from W0 on every adapter push (never accumulated onto an already merged weight), so
what it serves depends only on the last base and the last adapters it received. The adapters it
holds answer ``/weights_checksum`` like parameters do.
"""
from __future__ import annotations

from typing import Callable

import torch

from megarl.protocol.lora_names import SCALING, adapter_names, base_name, is_lora_name


class LoRAState:
    """The adapters and base weights one server holds (used on the engine thread only)."""

    def __init__(self):
        self.scaling: float | None = None
        self.adapters: dict[str, torch.Tensor] = {}  # HF adapter name -> tensor
        self.bases: dict[str, torch.Tensor] = {}  # canonical weight name -> W0 (full HF tensor)
        self.name: str | None = None  # the adapter /load_lora_adapter loaded (server/lora_routes.py)

    def tracks(self, name: str) -> bool:
        return name in self.bases

    def prepare(self, model, tensors: dict[str, torch.Tensor]
                ) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
        """The tensors to load for an update carrying ``tensors`` (adapters merged, the rest
        unchanged) and a commit to call once the load succeeded. Raises KeyError/ValueError naming
        the tensor for an adapter of an unknown module, a bad shape or a missing scale; nothing
        is changed then."""
        if not any(is_lora_name(n) for n in tensors) and not any(n in self.bases for n in tensors):
            return tensors, lambda: None
        scaling = self.scaling
        adapters = dict(self.adapters)
        rest, touched = {}, set()
        for name, t in tensors.items():
            if name == SCALING:
                scaling = float(t.reshape(-1)[0])
            elif is_lora_name(name):
                adapters[name] = t.detach().clone()
                touched.add(base_name(name))
            else:
                rest[name] = t
        bases = {n: rest[n].detach().clone() for n in rest if n in self.bases}
        touched |= set(bases)
        if scaling != self.scaling:  # a new scale changes every merged module
            touched |= {base_name(n) for n in adapters}
        for w in sorted(touched):
            mod = w[: -len(".weight")]
            a_name, b_name = adapter_names(mod)
            a, b = adapters.get(a_name), adapters.get(b_name)
            if a is None or b is None:
                continue  # the other half comes in a later bucket of this push
            if scaling is None:
                raise ValueError(f"{a_name}: an adapter without {SCALING!r} (alpha / r) pushed before it")
            if w not in model.params:
                raise KeyError(f"{a_name}: the model has no parameter {w!r} to adapt")
            shape = model.full_shape(w)
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or (b.shape[0], a.shape[1]) != tuple(shape):
                raise ValueError(f"{mod}: lora_B {tuple(b.shape)} @ lora_A {tuple(a.shape)} does not give "
                                 f"the weight's shape {tuple(shape)}")
            if w not in bases:
                bases[w] = self.bases[w] if w in self.bases else model.full_param(w).detach().clone()
            w0 = bases[w]
            rest[w] = (w0.float() + scaling * (b.float() @ a.float())).to(w0.dtype)

        def commit():
            self.scaling = scaling
            self.adapters = adapters
            self.bases.update(bases)

        return rest, commit

    def unload(self) -> dict[str, torch.Tensor]:
        """Forgets the adapters; returns the base weights to load back (W0 of every merged module)."""
        self.adapters, self.scaling, self.name = {}, None, None
        return dict(self.bases)

    def held(self, name: str) -> torch.Tensor:
        """An adapter tensor (or the scale) as last received; KeyError when none was."""
        if name == SCALING and self.scaling is not None:
            return torch.tensor([self.scaling], dtype=torch.float32)
        return self.adapters[name]
