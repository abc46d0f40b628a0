"""MoE routing replay (R3): the trainer's routers take the rollout engine's experts and weights.

    replay = RoutingReplay.install(chunks, ps)   # once, on the policy's model chunks
    replay.set(mb.routes)                        # per micro-batch, before its forward
    replay.set(None)                             # after the schedule: routers route themselves

`mb.routes` (`megarl.trainer.batch.Routes`) holds per token and per decoder layer the k expert
ids the rollout server routed that position to and the k weights it applied. In each MoE layer
of this process, per token t with a route:

    ids_t      = the rollout's ids                       (the experts the tokens are sent to)
    p_t        = the trainer's routing probabilities at ids_t (megatron-core's own score math:
                 softmax before or after the top-k, scaling factor - its topk function with a
                 replay hook that returns ids_t instead of its own top-k)
    weights_t  = w_t + (p_t - stop_grad(p_t))   when the rollout sent weights w_t (megarl-server)
               = p_t                            when it sent ids only (SGLang)

so the forward uses exactly the rollout's weights and the router still gets the gradient of its
own probabilities over the replayed experts (straight-through). Tokens without a route (padding,
a sample's last position, which fed no sampled token) keep the trainer's own top-k.

Why a hook on `TopKRouter.routing` rather than megatron-core's `moe_enable_routing_replay`
(transformer/moe/router_replay.py): that one replays ids only (the weights come from the
trainer's scores), for every token of the micro-batch (no per-token fallback), through a class-
level list of every router ever built (a reference model's routers join the policy's). Its
hook point - the ``router_replay`` argument of `topk_routing_with_score_function`, an object with
``get_replay_topk`` - is what `_ReplayTopK` fills in, so the score math stays megatron-core's.

The routing runs on each rank's own tokens before the expert-parallel all-to-all, so EP > 1
needs nothing more; under PP each stage's routers carry their global layer number (TransformerLayer
adds the stage offset), which indexes the route's layer axis. With sequence parallelism a
router sees its TP rank's slice of the sequence. The router's own routing still runs first
(aux / z-loss terms stay attached to the graph with a zero-valued term).

Written against megatron-core ``megarl.mcore.pins.SUPPORTED_MCORE_VERSION``. The internal names and
source lines used are rows of ``pins.ROUTING_REPLAY_PINS`` (tests/dist/test_mcore_pins.py fails by
name when one changes):

- ``transformer.moe.router.TopKRouter``: found in the model; its ``routing(logits, padding_mask)``
  is wrapped per instance (``forward`` calls ``self.routing(logits, padding_mask=...)``); its
  instance attributes ``topk``, ``score_function``, ``expert_bias``, ``config`` and
  ``layer_number`` (global, 1-based, set by ``MoELayer.set_layer_number``) are read.
- ``transformer.moe.moe_utils.topk_routing_with_score_function`` and its ``router_replay``
  argument: an object whose ``get_replay_topk(scores, topk, num_groups, group_topk,
  default_compute_topk)`` returns (scores at the chosen ids, ids).
- TransformerConfig fields ``moe_router_pre_softmax``, ``moe_router_num_groups``,
  ``moe_router_group_topk``, ``moe_router_topk_scaling_factor``.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["RoutingReplay", "replay_routing"]


class _ReplayTopK:
    """`topk_routing_with_score_function`'s ``router_replay`` hook: the replayed ids where a
    token has a route, megatron-core's own top-k elsewhere."""

    def __init__(self, ids: torch.Tensor, has: torch.Tensor):
        self.ids, self.has = ids, has  # [N, k] long, [N] bool

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        ids = torch.where(self.has.unsqueeze(1), self.ids.to(own.device), own)
        return scores.gather(1, ids), ids


def replay_routing(router, logits: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [N, E], routing_map [N, E] bool) of one router for logits [N, E] with the routes
    ids [N, k] (-1: none) and weights [N, k] (NaN: none) - module docstring."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    cfg = router.config
    has = ids[:, 0] >= 0
    p, routing_map = topk_routing_with_score_function(
        logits, router.topk, use_pre_softmax=cfg.moe_router_pre_softmax,
        num_groups=cfg.moe_router_num_groups, group_topk=cfg.moe_router_group_topk,
        scaling_factor=cfg.moe_router_topk_scaling_factor, score_function=router.score_function,
        expert_bias=router.expert_bias, fused=False,
        router_replay=_ReplayTopK(ids.clamp(min=0).long(), has))
    known = has & ~torch.isnan(weights[:, 0])
    w = torch.zeros_like(p).scatter(1, ids.clamp(min=0).long(), torch.nan_to_num(weights).to(p.dtype))
    # value w (the rollout's weight, exactly), gradient of p (the trainer's probabilities)
    return torch.where(known.unsqueeze(1), w + (p - p.detach()), p), routing_map


class RoutingReplay:
    """The replay hooks of one model's routers (module docstring)."""

    def __init__(self, routers: list[tuple[int, object]], ps=None, sequence_parallel: bool = False):
        self.routers = routers  # (0-based global decoder layer, TopKRouter)
        self.tp, self.tp_rank = (ps.tp, ps.tp_rank) if ps is not None else (1, 0)
        self.sequence_parallel = sequence_parallel
        self.current = None  # Routes [b, s, layers, k] of the micro-batch being run, or None
        self.replayed = 0  # (token, layer) routings taken from the rollout so far: a 0-dim tensor
        # once a route was replayed (no host sync per layer on a GPU)
        self._replayed = self._flipped = None  # since `take_stats`: routings replayed / where the
        # trainer's own top-k picked another expert set (what replay changed)

    @classmethod
    def install(cls, chunks, ps=None, sequence_parallel: bool = False) -> "RoutingReplay":
        """Wraps the ``routing`` of every TopKRouter in ``chunks`` (DDP-wrapped or bare)."""
        from megatron.core.transformer.moe.router import TopKRouter

        routers = []
        for chunk in chunks:
            for m in chunk.modules():
                if isinstance(m, TopKRouter):
                    routers.append((m.layer_number - 1, m))
        if not routers:
            raise ValueError("moe.routing_replay: the model has no MoE router")
        replay = cls(routers, ps, sequence_parallel)
        for layer, router in routers:
            router.routing = replay._wrap(layer, router, router.routing)
        return replay

    def set(self, routes) -> None:
        self.current = routes

    def take_stats(self, device="cpu") -> dict:
        """{"moe/route_flip_frac": Stat}: the share of replayed (token, layer) routings whose
        expert set differs from the one the trainer's router would pick, since the last call."""
        from megarl.algo.stats import Stat

        if self._replayed is None:  # no routed token here: the key still joins the DP reduce
            self._replayed = self._flipped = torch.zeros((), dtype=torch.int64, device=device)
        out = {"moe/route_flip_frac": Stat(self._flipped.double().to(device), self._replayed.double().to(device))}
        self._replayed = self._flipped = None
        return out

    def _layer_routes(self, layer: int, n_tokens: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """This layer's routes in megatron's token order ([s, b] flattened), [N, k] each."""
        r = self.current
        if r is None:
            return None
        if layer >= r.ids.shape[2]:
            raise ValueError(f"routing replay: routes cover {r.ids.shape[2]} layers, the model has layer {layer}")
        ids = r.ids[:, :, layer].transpose(0, 1)  # [s, b, k]
        w = r.weights[:, :, layer].transpose(0, 1)
        if self.sequence_parallel and self.tp > 1:  # this TP rank's slice of the sequence
            s = ids.shape[0] // self.tp
            ids, w = ids[self.tp_rank * s:(self.tp_rank + 1) * s], w[self.tp_rank * s:(self.tp_rank + 1) * s]
        k = ids.shape[-1]
        ids, w = ids.reshape(-1, k), w.reshape(-1, k)
        if ids.shape[0] != n_tokens:
            raise ValueError(f"routing replay: {ids.shape[0]} routed tokens for a router input of {n_tokens}")
        return ids, w

    def _wrap(self, layer: int, router, routing):
        def replayed(logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
            probs, routing_map = routing(logits, padding_mask=padding_mask)
            routes = self._layer_routes(layer, probs.shape[0])
            if routes is None:
                return probs, routing_map
            flat = logits.reshape(-1, logits.shape[-1])
            new_probs, new_map = replay_routing(router, flat, *routes)
            has = routes[0][:, 0] >= 0
            n, flips = has.sum(), ((routing_map != new_map).any(-1) & has.to(new_map.device)).sum()
            self.replayed = self.replayed + n
            self._replayed = n if self._replayed is None else self._replayed + n
            self._flipped = flips if self._flipped is None else self._flipped + flips
            # + 0 * probs keeps the router's own aux / z-loss terms attached to the graph
            return new_probs + probs * 0.0, new_map

        return replayed
