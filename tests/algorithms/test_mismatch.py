"""Train/inference mismatch corrections (algorithms/mismatch.py) and routing drift counts
(algorithms/routing_drift.py) against their equations on hand-made tensors."""
from __future__ import annotations

import math

import pytest
import torch

from gspo_megatron.algorithms import grpo_loss, gspo_loss, gspo_token_loss
from gspo_megatron.algorithms.mismatch import mismatch_correction
from gspo_megatron.algorithms.routing_drift import changed_expert_sets, drift_counts

F64 = torch.float64
MASK = torch.tensor([[False, True, True, True], [False, True, True, False]])
OLD = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -3.0, -1.0, 9.0]], dtype=F64)
# d = old - engine on trained tokens: row 0: [0.5, -0.3, 1.2]; row 1: [-0.9, 0.2]
ENG = OLD - torch.tensor([[7.0, 0.5, -0.3, 1.2], [7.0, -0.9, 0.2, 7.0]], dtype=F64)


def test_token_tis_weights():
    c = mismatch_correction(OLD, ENG, MASK, tis_cap=2.0)
    want = torch.tensor([[1.0, math.exp(0.5), math.exp(-0.3), 2.0], [1.0, math.exp(-0.9), math.exp(0.2), 1.0]],
                        dtype=F64)
    assert torch.allclose(c.token_weights, want) and c.row_weights is None
    assert torch.equal(c.loss_mask, MASK)
    assert c.totals["tis_truncated_tokens"] == 1  # exp(1.2) > 2


def test_sequence_is_is_the_capped_geometric_mean():
    c = mismatch_correction(OLD, ENG, MASK, seq_is_cap=1.5)
    g0, g1 = math.exp((0.5 - 0.3 + 1.2) / 3), math.exp((-0.9 + 0.2) / 2)
    assert torch.allclose(c.row_weights, torch.tensor([min(g0, 1.5), g1], dtype=F64))
    assert c.totals["seq_is_truncated_sequences"] == (g0 > 1.5)


def test_token_mis_masks_tokens_outside_the_interval():
    # C = 2: [1/2, 2]; exp(1.2) = 3.3 and exp(-0.9) = 0.41 leave it
    c = mismatch_correction(OLD, ENG, MASK, mis_cap=2.0, mis_level="token")
    assert c.loss_mask.tolist() == [[False, True, True, False], [False, False, True, False]]
    assert c.totals["mis_masked_tokens"] == 2


def test_sequence_mis_masks_whole_rows():
    # geometric means: row 0 exp(1.4 / 3) = 1.59, row 1 exp(-0.35) = 0.70; C = 1.5: [0.67, 1.5]
    c = mismatch_correction(OLD, ENG, MASK, mis_cap=1.5, mis_level="sequence")
    assert c.loss_mask.tolist() == [[False] * 4, MASK[1].tolist()]
    assert c.totals["mis_masked_sequences"] == 1


def test_mismatch_metrics_and_identity():
    c = mismatch_correction(OLD, ENG, MASK)
    d = torch.tensor([0.5, -0.3, 1.2, -0.9, 0.2], dtype=F64)
    assert math.isclose(float(c.totals["mismatch_abs_sum"]), float(d.abs().sum()))
    assert math.isclose(float(c.totals["mismatch_k3_sum"]), float((torch.exp(d) - 1 - d).sum()))
    same = mismatch_correction(OLD, OLD.clone(), MASK, tis_cap=2.0, seq_is_cap=2.0, mis_cap=2.0)
    assert torch.equal(same.token_weights, torch.ones_like(OLD)) and torch.equal(same.row_weights, torch.ones(2, dtype=F64))
    assert torch.equal(same.loss_mask, MASK) and same.totals["mismatch_abs_sum"] == 0
    with pytest.raises(ValueError, match="tis_cap=0.5: expected >= 1"):
        mismatch_correction(OLD, ENG, MASK, tis_cap=0.5)


@pytest.mark.parametrize("fn", [gspo_loss, gspo_token_loss, grpo_loss])
def test_losses_take_the_weights_as_constants(fn):
    g = torch.Generator().manual_seed(0)
    lp = (OLD + 0.01 * torch.randn(OLD.shape, generator=g, dtype=F64)).requires_grad_(True)
    adv = torch.tensor([1.0, -0.5], dtype=F64)
    if fn is gspo_token_loss:
        adv = adv[:, None].expand(2, 4)
    c = mismatch_correction(OLD, ENG, MASK, tis_cap=2.0, seq_is_cap=2.0)
    kw = dict(eps_low=0.5, eps_high=0.5)
    weighted, _ = fn(lp, OLD, adv, MASK, token_weights=c.token_weights, row_weights=c.row_weights, **kw)
    plain, _ = fn(lp, OLD, adv, MASK, **kw)
    ones, _ = fn(lp, OLD, adv, MASK, token_weights=torch.ones_like(OLD), row_weights=torch.ones(2, dtype=F64), **kw)
    assert torch.allclose(ones, plain)
    # by hand: a row's term x row weight x (per-token losses: each token x its weight; gspo: the
    # mean token weight)
    per_row = []
    for i in range(2):
        m = MASK[i]
        if fn is gspo_loss:
            s = torch.exp((lp[i] - OLD[i])[m].mean())
            term = -s * adv[i] * c.token_weights[i][m].mean()
        else:
            ratio = torch.exp(lp[i] - lp[i].detach()) * torch.exp((lp[i] - OLD[i])[m].mean()).detach() \
                if fn is gspo_token_loss else torch.exp(lp[i] - OLD[i])
            a = adv[i] if fn is gspo_token_loss else adv[i]
            term = (-(ratio * a) * c.token_weights[i])[m].mean()
        per_row.append(term * c.row_weights[i])
    assert torch.allclose(weighted, torch.stack(per_row).mean())


def test_drift_is_a_hand_count_and_zero_without_change():
    old = torch.tensor([[[0, 1], [2, 3], [1, 0]], [[3, 2], [0, 2], [-1, -1]]])  # [rows, positions, k]
    new = torch.tensor([[[1, 0], [2, 1], [1, 0]], [[3, 2], [1, 2], [0, 1]]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    assert changed_expert_sets(old, new).tolist() == [[False, True, False], [False, True, True]]
    changed, total = drift_counts(old, new, mask)
    assert (int(changed), int(total)) == (2, 4)  # the masked and the unrouted (-1) token are not compared
    assert [int(x) for x in drift_counts(old, old, mask)] == [0, 4]
