"""``optim.freeze``: HF tensor-name patterns whose Megatron parameters do not train.

Patterns are shell-style (``fnmatch.fnmatchcase``: ``*`` also crosses dots, ``?`` and ``[0-3]``
match one character) and are matched against the HF checkpoint's tensor names, the names a
slime/verl user already knows (``model.embed_tokens.weight``, ``model.layers.0.*``). A Megatron
row fuses several HF tensors (QKV, gate/up): it is frozen when every one of them matches; a
pattern that catches only part of a fused row, or no tensor at all, is a ConfigError, as is
freezing everything. Frozen parameters get ``requires_grad`` False before DDP and the optimizer
are built, so neither holds gradients or Adam state for them, and ``weights.delta`` skips them
from the second push on."""
from __future__ import annotations

from fnmatch import fnmatchcase

from megarl.common.errors import ConfigError
from megarl.protocol.hf_model import ModelArgs, param_table


def frozen_rows(patterns: list[str], args: ModelArgs) -> frozenset[str]:
    """Megatron row names (``{L}`` filled in) that ``patterns`` freeze; pure."""
    if not patterns:
        return frozenset()
    hits = {p: 0 for p in patterns}  # per pattern, so one that matches nothing is named
    frozen, rows = set(), 0
    for layer, pmap in param_table(args):
        mcore, hf = pmap.names(layer)
        rows += 1
        matched = [h for h in hf if any(fnmatchcase(h, p) for p in patterns)]
        for p in patterns:
            hits[p] += sum(fnmatchcase(h, p) for h in hf)
        # a fused row is one tensor in Megatron: it cannot be half frozen
        if matched and len(matched) < len(hf):
            raise ConfigError(f"optim.freeze: {matched[0]!r} is fused with "
                              f"{', '.join(repr(h) for h in hf if h not in matched)} in one Megatron "
                              f"parameter ({mcore}); freeze all of them or none")
        if matched:
            frozen.add(mcore)
    for p, n in hits.items():
        if not n:
            raise ConfigError(f"optim.freeze: pattern {p!r} matches no tensor of {args.architecture} "
                              f"(HF names such as 'model.embed_tokens.weight', 'model.layers.0.*')")
    if len(frozen) == rows:
        raise ConfigError("optim.freeze: the patterns freeze every parameter; nothing is left to train")
    return frozenset(frozen)


def apply_freeze(chunks, args: ModelArgs, patterns: list[str], use_te: bool) -> int:
    """Sets ``requires_grad`` False on this rank's parameters of the frozen rows (the bare
    chunks, before DDP); returns how many local parameters it froze."""
    rows = frozen_rows(patterns, args)
    if not rows:
        return 0
    from megarl.models.hf_io import local_params

    n = 0
    for lp in local_params(chunks, args, use_te):
        if lp.pmap.names(lp.layer)[0] in rows:
            # before DDP and the optimizer exist: neither allocates a gradient or Adam state for it
            lp.param.requires_grad_(False)
            n += 1
    return n
