"""Routing drift counts (algorithms/routing_drift.py) against a hand count."""
from __future__ import annotations

import pytest
import torch

from gspo_megatron.algorithms.routing_drift import changed_expert_sets, drift_counts


def test_drift_hand_count():
    # 2 rows x 3 positions, top-2 sets of one layer
    old = torch.tensor([[[0, 1], [2, 3], [1, 0]], [[4, 5], [5, 6], [-1, -1]]])
    new = torch.tensor([[[1, 0], [2, 4], [1, 0]], [[4, 5], [7, 6], [0, 1]]])
    # position by position: same set (order differs), changed, same | same, changed, no old routing
    assert changed_expert_sets(old, new).tolist() == [[False, True, False], [False, True, True]]
    mask = torch.tensor([[True, True, False], [True, True, True]])
    changed, compared = drift_counts(old, new, mask)
    # trained and routed in both: (0,0) same, (0,1) changed, (1,0) same, (1,1) changed; (0,2) is
    # not trained, (1,2) has no old routing
    assert (int(changed), int(compared)) == (2, 4)


def test_drift_zero_when_nothing_changed():
    sets = torch.randint(0, 8, (5, 7, 3, 2))
    changed, compared = drift_counts(sets, sets.clone(), torch.ones(5, 7, 3, dtype=torch.bool))
    assert int(changed) == 0 and int(compared) == 5 * 7 * 3
    perm = sets.flip(-1)  # the same sets in another order
    assert int(drift_counts(sets, perm, torch.ones(5, 7, 3, dtype=torch.bool))[0]) == 0


def test_shapes_must_match():
    with pytest.raises(ValueError, match="differ"):
        changed_expert_sets(torch.zeros(2, 2), torch.zeros(3, 2))
