"""Which weight version computed each of the engine's recorded routes, and the two passes that
depend on it: pi_old per version under routing replay, and the check of the recorded routes
against the weights of their version.

    versions = route_versions(batch)           # per input position, like batch.weight_versions
    part_routes = routes_of_version(batch, 6)  # only the rows version 6's forward passes computed
    metrics = version_mismatch(forward_only, batch, [5, 6], weights_of, live=6, rows=4)

A route recorded at input position p is the top-k of the forward pass that sampled token p + 1
(rollout/generation/sample.py; SGLang's retracts: rollout/in_server/released_routes.py), so its
version is that of the first model token after p: prompt positions belong to the first generate
call, an environment token's position to the next model turn. A response cut by a weight sync
(a partial rollout resumed, a retracted request, the next turn of an episode) was read again by
the later call's prefill, under its weights and with the router's own choice at every position;
the tokens that call sampled saw that prefix, not the recorded routes of the earlier positions.

So pi_old of version v's tokens (Actor.compute_old_log_probs with `versions`) replays only the
routes version v computed, and lets the routers choose at the earlier positions, under v's
weights: the engine's forward exactly, whatever cut the response (up to the engine's in_place
pause, where the later tokens attend over the earlier weights' KV cache: no single version's
pass is that). The train step, one pass under the current weights, replays every recorded route
(router_control.py): each position is routed as the pass that sampled its next token routed it.

version_mismatch (routing/version_mismatch) is the check that a recorded route is what the
weights of its token's version choose: on a few rows, a forward pass per version the trainer
still holds, without replay, compared with the record at the positions that predict that
version's trained tokens. Zero when the routes are paired, up to the engine's near-ties; stock
SGLang's retract gave every pre-retract row the new weights' routes.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, ContextManager

import torch

from gspo_megatron.actor.batching.batch import ROUTE_NONE_U8, TrainBatch


def _suffix_min(x: torch.Tensor) -> torch.Tensor:
    """out[..., p] = min(x[..., p:]) along the last axis."""
    return torch.flip(torch.cummin(torch.flip(x, [-1]), dim=-1).values, [-1])


def route_versions(batch: TrainBatch) -> torch.Tensor:
    """Per input position (the shape of batch.tokens, padded or packed): the weight version of the
    first model token after it in its row (weight_versions >= 0), the version whose forward
    computed the route there; -1 where no model token follows."""
    v = batch.weight_versions
    if v is None:
        raise ValueError("route_versions needs batch.weight_versions")
    n = v.shape[-1]
    idx = torch.arange(n, device=v.device).expand_as(v)
    nearest = _suffix_min(torch.where(v >= 0, idx, n))       # first model token at q >= p
    after = torch.cat([nearest[..., 1:], torch.full_like(nearest[..., :1], n)], -1)  # q >= p + 1
    if batch.is_packed:  # a row's positions must not reach into the next row
        ends = torch.repeat_interleave(batch.offsets[1:].to(v.device), batch.lengths.to(v.device))
        valid = after < ends
    else:
        valid = after < n
    return torch.where(valid, v.gather(-1, after.clamp(max=n - 1)), -1)


def routes_of_version(batch: TrainBatch, version: int) -> torch.Tensor | None:
    """batch.routed_experts with the rows other versions computed set to "no routing" (255 in
    the compact uint8 form, -1 in int16): a replaying pass then routes those positions itself."""
    routes = batch.routed_experts
    if routes is None:
        return None
    keep = route_versions(batch) == version
    none = ROUTE_NONE_U8 if routes.dtype == torch.uint8 else -1
    return torch.where(keep[..., None, None].to(routes.device), routes, torch.full_like(routes, none))


def version_mismatch(forward_only: Callable[[TrainBatch], tuple[object, dict[str, float]]],
                     batch: TrainBatch, versions: list[int], weights_of: Callable[[int], ContextManager],
                     live: int | None, rows: int) -> dict[str, float]:
    """routing_version_mismatch: changed / compared (token, layer) top-k sets between the recorded
    routes and the router's own choice under each version's weights, on the first `rows` rows of
    this rank's batch, at the positions predicting that version's trained tokens (`live` and None
    run with the weights in place: None compares every trained token with them). forward_only(part)
    runs one pass without replay and returns the engine comparison's metrics; one pass per entry
    of `versions`, the same list on every rank (collective)."""
    sub = batch.select(slice(0, rows))
    changed = compared = 0.0
    for v in versions:
        mine = sub.loss_mask if v is None else sub.loss_mask & (sub.weight_versions == v)
        with contextlib.nullcontext() if v == live or v is None else weights_of(v):
            _, m = forward_only(dataclasses.replace(sub, loss_mask=mine))
        sets = m.get("routing_engine_mismatch_sets", 0.0)
        compared += sets
        changed += round(m.get("routing_engine_mismatch", 0.0) * sets)  # an integer count
    return {"routing_version_mismatch": changed / compared if compared else 0.0,
            "routing_version_mismatch_sets": compared}
