"""actor/batching/batch.py: the alignment checks, DP shards of mini-batches, micro-batches with fillers."""
from __future__ import annotations

import pytest
import torch

from gspo_megatron.actor.batching.batch import TrainBatch, balanced_sizes
from gspo_megatron.actor.batching.micro_batch import micro_batches


def _batch(b=11, s=12, seed=0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, s + 1, (b,), generator=g)
    t = torch.arange(s)[None]
    mask = (t >= 2) & (t < lengths[:, None])
    return TrainBatch(tokens=torch.randint(0, 50, (b, s), generator=g), lengths=lengths, loss_mask=mask,
                      advantages=torch.randn(b, generator=g), rollout_log_probs=torch.randn(b, s, generator=g))


def test_balanced_sizes():
    assert balanced_sizes(11, 2) == [6, 5]
    assert balanced_sizes(2, 4) == [1, 1, 0, 0]


@pytest.mark.parametrize("change, message", [
    (dict(loss_mask=torch.ones(2, 4, dtype=torch.bool)), r"loss_mask\[:, 0\] must be False"),
    (dict(lengths=torch.tensor([4, 5])), r"lengths must lie in \[1, 4\]"),
    (dict(advantages=torch.zeros(3)), r"advantages have shape \(3,\), expected \(2,\) or \(2, 4\)"),
    (dict(rollout_log_probs=torch.zeros(2, 3)), r"rollout_log_probs has shape \(2, 3\), expected \(2, 4\)"),
])
def test_bad_batches_name_the_problem(change, message):
    fields = dict(tokens=torch.zeros(2, 4, dtype=torch.long), lengths=torch.tensor([4, 2]),
                  loss_mask=torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0]], dtype=torch.bool),
                  advantages=torch.zeros(2))
    with pytest.raises(ValueError, match=message):
        TrainBatch(**{**fields, **change})


def test_mask_beyond_length_is_rejected():
    with pytest.raises(ValueError, match="padding position"):
        TrainBatch(tokens=torch.zeros(1, 4, dtype=torch.long), lengths=torch.tensor([2]),
                   loss_mask=torch.tensor([[0, 1, 1, 0]], dtype=torch.bool), advantages=torch.zeros(1))


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_rank_mini_batches_are_parts_of_the_global_mini_batches(dp):
    batch = _batch()
    shards = [batch.shard(r, dp, num_mini_batches=2) for r in range(dp)]
    global_minis = batch.split(balanced_sizes(batch.num_rows, 2))
    for k, mini in enumerate(global_minis):
        rows = torch.cat([s.mini_batches()[k].global_rows for s in shards])
        start = sum(balanced_sizes(batch.num_rows, 2)[:k])
        assert rows.tolist() == list(range(start, start + mini.num_rows))
        for s in shards:
            part = s.mini_batches()[k]
            for j, g in enumerate(part.global_rows.tolist()):
                n = int(batch.lengths[g])
                assert torch.equal(part.tokens[j, :n], batch.tokens[g, :n])
                assert torch.equal(part.loss_mask[j, :n], batch.loss_mask[g, :n])


def test_old_log_probs_travel_with_rows():
    batch = _batch()
    shard = batch.shard(1, 2, num_mini_batches=2)
    shard.old_log_probs = shard.rollout_log_probs + 1.0
    for mini in shard.mini_batches():
        assert torch.equal(mini.old_log_probs, mini.rollout_log_probs + 1.0)


def test_micro_batches_fill_empty_ones_and_pad_to_multiple():
    batch = _batch(b=3)
    mbs = micro_batches(batch, 4, seq_multiple=4)
    assert [mb.rows.tolist() for mb in mbs] == [[0], [1], [2], [-1]]
    assert not mbs[3].loss_mask.any()  # the filler trains nothing
    for mb in mbs:
        assert mb.tokens.shape[1] % 4 == 0
        assert mb.position_ids[0].tolist() == list(range(mb.tokens.shape[1]))
    empty = batch.select(slice(0, 0))
    assert [mb.rows.tolist() for mb in micro_batches(empty, 2)] == [[-1], [-1]]


# --- the packed form: real tokens only, from the driver to the micro-batches -----------
def _equal(a: TrainBatch, b: TrainBatch) -> None:
    import dataclasses
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), f.name


def _with_routes(batch: TrainBatch, token_advantages: bool = False) -> TrainBatch:
    import dataclasses
    engine = batch.rollout_log_probs
    assert engine is not None
    b, s = batch.tokens.shape
    real = torch.arange(s)[None] < batch.lengths[:, None]
    routes = torch.where(real[..., None, None], torch.randint(0, 9, (b, s, 3, 2)), -1).to(torch.int16)
    adv = torch.where(batch.loss_mask, torch.randn(b, s), 0.0) if token_advantages else batch.advantages
    return dataclasses.replace(batch, routed_experts=routes, advantages=adv,  # padding as the rollout's
                               weight_versions=torch.where(real, 4, -1), tokens=torch.where(real, batch.tokens, 0),
                               rollout_log_probs=torch.where(real, engine, 0.0))


@pytest.mark.parametrize("token_advantages", [False, True])
def test_packed_form_round_trips_and_splits_as_the_padded_one(token_advantages):
    padded = _with_routes(_batch(), token_advantages)
    packed = padded.packed()
    assert packed.is_packed and packed.tokens.numel() == int(padded.lengths.sum())
    assert packed.is_token_field("advantages") == token_advantages
    _equal(packed.padded(), padded)  # the padding comes back with its values (-1 for routes, versions)
    # uint8 routes (a byte per expert id, 255 = none) widen back to the same int16
    from gspo_megatron.actor.batching.batch import compact_routes
    import dataclasses
    _equal(dataclasses.replace(packed, routed_experts=compact_routes(packed.routed_experts)).padded(), padded)
    for rows in ([3, 0, 7], [5]):
        _equal(packed.select(rows).padded(), padded.select(rows))
    empty = packed.select([])  # a DP rank without rows (fewer rows than ranks)
    assert empty.num_rows == 0 and empty.tokens.numel() == 0 and micro_batches(empty, 1)[0].rows.tolist() == [-1]
    for a, b in zip(packed.shard(1, 3, 2).mini_batches(), padded.shard(1, 3, 2).mini_batches()):
        _equal(a.padded(), b)
        assert a.num_valid_sequences() == b.num_valid_sequences()
        assert torch.equal(a.row_sums(a.loss_mask.long()), b.loss_mask.sum(1))
        real = torch.arange(b.padded_shape[1])[None] < b.lengths[:, None]
        assert torch.equal(a.token_advantages(), b.token_advantages()[real])
    for i in range(padded.num_rows):
        assert torch.equal(packed.row_values("tokens", i), padded.tokens[i, :int(padded.lengths[i])])
    # a micro-batch of packed rows is the padded rows' micro-batch
    for a, b in zip(micro_batches(packed, 3), micro_batches(padded, 3)):
        for f in dataclasses.fields(a):
            x, y = getattr(a, f.name), getattr(b, f.name)
            assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), f.name


@pytest.mark.parametrize("change, message", [
    (dict(tokens=torch.zeros(5, dtype=torch.long)), r"packed tokens hold 5 tokens, lengths sum to 6"),
    (dict(loss_mask=torch.ones(6, dtype=torch.bool)), r"loss_mask is True at a row's first token"),
    (dict(rollout_log_probs=torch.zeros(4)), r"rollout_log_probs has shape \(4,\), expected \(6, ...\)"),
    (dict(advantages=torch.zeros(3)), r"advantages have shape \(3,\), expected \(2,\) or \(6,\)"),
    (dict(routed_experts=torch.zeros(6, 2, 2, 1)), r"routed_experts has shape \(6, 2, 2, 1\), expected \(6, layers, top-k\)"),
    (dict(routed_experts=torch.zeros(6, 2, 2), route_layers=[0]), r"route_layers \[0\] name 1 layers, routed_experts hold 2"),
])
def test_bad_packed_batches_name_the_problem(change, message):
    fields = dict(tokens=torch.zeros(6, dtype=torch.long), lengths=torch.tensor([4, 2]),
                  loss_mask=torch.tensor([0, 1, 1, 1, 0, 1], dtype=torch.bool), advantages=torch.zeros(2))
    with pytest.raises(ValueError, match=message):
        TrainBatch(**{**fields, **change})


def test_largest_expert_id_reads_compact_routes_without_widening_them():
    """check_routed_experts' bound: the largest id, the 255 / -1 of tokens without routing aside,
    across the 16M-entry chunks of uint8 routes."""
    from gspo_megatron.actor.batching.batch import compact_routes, largest_expert_id
    routes = torch.full(((1 << 24) + 40, 2), -1, dtype=torch.int16)
    routes[5] = 3
    routes[-1, 1] = 201  # in the second chunk
    assert largest_expert_id(routes) == 201 and largest_expert_id(compact_routes(routes)) == 201
    none = torch.full((4, 2), -1, dtype=torch.int16)
    assert largest_expert_id(none) == 0 == largest_expert_id(compact_routes(none))
