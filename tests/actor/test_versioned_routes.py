"""Which version computed each recorded route (actor/held/versioned_routes.py): the first model token
after the position, row by row, in both batch forms; a version's pass keeps only its own rows. The
passes that use them, against a live server's retracted and resumed samples:
tests/rollout/test_routes_paired.py."""
from __future__ import annotations

import torch

from gspo_megatron.actor.batching.batch import ROUTE_NONE_U8, TrainBatch
from gspo_megatron.actor.held.versioned_routes import route_versions, routes_of_version


def _batch(routes_dtype=torch.uint8) -> TrainBatch:
    """Row 0: prompt 3, two tokens of v5, two of v6 (a response cut by a sync). Row 1: prompt 2,
    a v6 turn of one token, two environment tokens, a v7 turn of one token (an episode)."""
    versions = torch.tensor([-1, -1, -1, 5, 5, 6, 6, -1, -1, 6, -1, -1, 7])
    routes = torch.arange(13 * 2 * 2).reshape(13, 2, 2) % 4
    return TrainBatch(tokens=torch.arange(13), lengths=torch.tensor([7, 6]), loss_mask=versions >= 0,
                      advantages=torch.zeros(2), weight_versions=versions, routed_experts=routes.to(routes_dtype))


def test_route_versions_packed_and_padded():
    want = [5, 5, 5, 5, 6, 6, -1, 6, 6, 7, 7, 7, -1]  # prompt: the first call's; env: the next turn's
    batch = _batch()
    assert route_versions(batch).tolist() == want
    assert route_versions(batch.padded()).tolist() == [want[:7], want[7:] + [-1]]


def test_a_versions_pass_keeps_only_its_own_routes():
    for dtype, none in ((torch.uint8, ROUTE_NONE_U8), (torch.int16, -1)):
        batch = _batch(dtype)
        mine = routes_of_version(batch, 6)
        kept = torch.tensor([p in (4, 5, 7, 8) for p in range(13)])
        assert torch.equal(mine[kept], batch.routed_experts[kept])
        assert (mine[~kept] == none).all() and mine.dtype == dtype
        padded = routes_of_version(batch.padded(), 6)
        assert torch.equal(padded[0, 4:6], batch.routed_experts[4:6].to(padded.dtype))
        assert (padded[0, :4] == -1).all() and (padded[1, 2:] == -1).all()
