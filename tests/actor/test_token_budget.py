"""actor/batching/token_budget.py: rows grouped longest first up to a token budget, split to an agreed count.
(The same on real process groups, against one process: tests/actor/test_actor_layouts.py.)"""
from __future__ import annotations

import random

import pytest

from gspo_megatron.actor.batching.token_budget import computed_tokens, plan_micro_batches, split_to_count


def test_longest_first_within_rows_and_budget():
    lengths = [5, 40, 12, 38, 7, 39, 11]
    plan = plan_micro_batches(lengths, max_rows=3, max_tokens=90)
    assert plan == [[1, 5], [3, 2], [6, 4, 0]]  # 2x40=80 ok, 3x40=120 > 90; ...
    for p in plan:
        assert len(p) <= 3 and computed_tokens([lengths[i] for i in p], packed=False) <= 90
    assert sorted(i for p in plan for i in p) == list(range(len(lengths)))
    assert plan_micro_batches(lengths, max_rows=100) == [[1, 5, 3, 2, 6, 4, 0]]


def test_budget_counts_padding_to_the_tp_multiple_and_packed_sums():
    assert computed_tokens([5, 7], packed=False, seq_multiple=4) == 2 * 8
    assert computed_tokens([5, 7], packed=True, seq_multiple=4) == 12
    assert plan_micro_batches([7, 7, 7], max_rows=8, max_tokens=16, seq_multiple=4) == [[0, 1], [2]]
    assert plan_micro_batches([7, 7, 7], max_rows=8, max_tokens=24, packed=True) == [[0, 1, 2]]


def test_a_row_longer_than_the_budget_is_alone():
    assert plan_micro_batches([100, 3, 4], max_rows=8, max_tokens=10) == [[0], [2, 1]]


def test_random_plans_keep_every_row_once_and_the_budget():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 64) for _ in range(rng.randint(0, 40))]
        budget, rows = rng.randint(64, 400), rng.randint(1, 9)
        plan = plan_micro_batches(lengths, max_rows=rows, max_tokens=budget, seq_multiple=2)
        assert sorted(i for p in plan for i in p) == list(range(len(lengths)))
        for p in plan:
            assert len(p) <= rows
            assert len(p) == 1 or computed_tokens([lengths[i] for i in p], packed=False,
                                                  seq_multiple=2) <= budget
        target = len(plan) + rng.randint(0, 5)
        more = split_to_count(plan, target)
        assert len(more) == target and sorted(i for p in more for i in p) == list(range(len(lengths)))


def test_split_to_count_halves_the_largest_then_adds_fillers():
    assert split_to_count([[0, 1, 2, 3], [4]], 3) == [[0, 1], [2, 3], [4]]
    assert split_to_count([[0], [1]], 4) == [[0], [1], [], []]
    assert split_to_count([[]], 2) == [[], []]
    with pytest.raises(ValueError, match="cannot shrink"):
        split_to_count([[0], [1]], 1)


def test_rollout_order_is_the_old_equal_row_split():
    from gspo_megatron.actor.batching.batch import balanced_sizes
    lengths = [5, 40, 12, 38, 7, 39, 11]
    plan = plan_micro_batches(lengths, max_rows=3, longest_first=False)
    assert plan == [[0, 1, 2], [3, 4], [5, 6]] and [len(p) for p in plan] == balanced_sizes(7, 3)
    # rows in order x longest row: the padding longest-first removes
    before = sum(computed_tokens([lengths[i] for i in p], packed=False) for p in plan)
    after = sum(computed_tokens([lengths[i] for i in p], packed=False)
                for p in plan_micro_batches(lengths, max_rows=3))
    assert (before, after) == (3 * 40 + 2 * 38 + 2 * 39, 3 * 40 + 3 * 12 + 1 * 5)  # 274 vs 161


def test_a_packed_micro_batch_counts_its_pack_not_its_rows():
    """model_tokens (the padding metric and max_micro_batch_tokens) of a packed micro-batch is
    the pack's length: the real tokens rounded up to the multiple, not rows x longest row."""
    import torch

    from gspo_megatron.actor.batching.batch import TrainBatch
    from gspo_megatron.actor.batching.micro_batch import micro_batch
    from gspo_megatron.actor.batching.token_budget import model_tokens, padding_stats
    from gspo_megatron.actor.batching.packing import pack
    lengths = torch.tensor([9, 3, 6])
    t = torch.arange(9)[None]
    batch = TrainBatch(tokens=torch.randint(3, 50, (3, 9)), lengths=lengths,
                       loss_mask=(t >= 1) & (t < lengths[:, None]), advantages=torch.zeros(3))
    mb = micro_batch(batch, 0, [0, 1, 2])
    assert model_tokens(mb) == 27 and padding_stats([mb]) == (18, 27)
    mb.packed = pack(mb.tokens, mb.lengths, multiple=4)
    assert model_tokens(mb) == 20 and padding_stats([mb]) == (18, 20)
