"""actor/batching/balance.py: the rows of each mini-batch shared among the DP ranks by work.
The multi-rank proof that any such split trains the one-process loss and gradients is
test_actor_layouts.py::test_skewed_lengths_balanced_by_work_equal_one_process."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from gspo_megatron.actor.batching.balance import karmarkar_karp, plan_shards, row_work, token_imbalance


def _lognormal_lengths(n: int, seed: int, cap: int = 20000) -> list[int]:
    """RL-like lengths: a 512-token prompt plus a lognormal response (median ~1.5k), capped."""
    r = random.Random(seed)
    return [min(cap, 512 + int(r.lognormvariate(7.3, 1.0))) for _ in range(n)]


def test_karmarkar_karp_on_known_instances():
    assert karmarkar_karp([5, 4, 3, 3, 2, 1], 2) == [[0, 3, 5], [1, 2, 4]]  # 9 / 9
    assert karmarkar_karp([8, 7, 6, 5, 4], 2) == [[1, 3, 4], [0, 2]]  # 16 / 14 (the best: 15 / 15)
    assert karmarkar_karp([100, 1, 1], 2) == [[0], [1, 2]]
    assert karmarkar_karp([1, 1], 3) == [[0], [1], []]  # fewer rows than ranks: one rank gets none
    assert karmarkar_karp([], 2) == [[], []]
    with pytest.raises(ValueError, match="work\\[1\\] = -1"):
        karmarkar_karp([1, -1], 2)


@pytest.mark.parametrize("parts", [2, 3])
def test_karmarkar_karp_is_close_to_the_best_partition(parts):
    """Against every assignment of small random instances: the heaviest part is within 15% of the
    best possible (KK's worst cases are far rarer than row-count splits' on long tails)."""
    r = random.Random(parts)
    for _ in range(30):
        work = [r.randint(1, 100) for _ in range(8)]
        best = min(max(sum(w for w, p in zip(work, a) if p == k) for k in range(parts))
                   for a in itertools.product(range(parts), repeat=len(work)))
        got = karmarkar_karp(work, parts)
        assert sorted(i for part in got for i in part) == list(range(len(work)))
        assert max(sum(work[i] for i in part) for part in got) <= 1.15 * best, (work, got, best)


def test_paper_like_lengths_are_even_where_row_counts_are_not():
    """1,024 rows of lognormal lengths up to 20k, 4 mini-batches, DP4 and DP8: the worst
    mini-batch's token imbalance is at most 1.05 balanced by tokens or by FLOPs;
    cut by row count it is not."""
    from model_specs.param_count import param_count
    from model_specs.hf.published import QWEN3_30B_A3B
    from model_specs.shape import model_shape_for
    shape = model_shape_for(QWEN3_30B_A3B)
    c = shape.config
    lengths = _lognormal_lengths(1024, seed=0)
    for dp in (4, 8):
        for mode in ("tokens", "flops"):
            work = row_work(lengths, mode, active_params=param_count(shape).active,
                            attention_width=c.num_layers * c.num_attention_heads * c.kv_channels)
            worst = max(token_imbalance(lengths, parts) for parts in plan_shards(1024, dp, 4, work))
            assert worst <= 1.05, (dp, mode, worst)
        by_rows = max(token_imbalance(lengths, parts) for parts in plan_shards(1024, dp, 4))
        assert by_rows > 1.1, (dp, by_rows)


def test_flops_weigh_attention_quadratically():
    w = row_work([1000, 2000], "flops", active_params=10**6, attention_width=1000)
    assert w[1] / w[0] == pytest.approx(2 * (10**6 + 2 * 10**6) / (10**6 + 10**6))
    assert row_work([3, 4], "tokens") == [3.0, 4.0]
    with pytest.raises(ValueError, match="dp_balance='bytes'"):
        row_work([3], "bytes")


def test_mini_batches_are_the_same_samples_whatever_the_dp_size():
    lengths = _lognormal_lengths(203, seed=1)
    work = [float(n) for n in lengths]
    one = [sorted(i for part in mb for i in part) for mb in plan_shards(203, 1, 4, work)]
    assert one == [list(range(0, 51)), list(range(51, 102)), list(range(102, 153)), list(range(153, 203))]
    for dp in (2, 3, 4, 8):
        plan = plan_shards(203, dp, 4, work)
        assert [sorted(i for part in mb for i in part) for mb in plan] == one
        assert plan == plan_shards(203, dp, 4, list(work))  # the same on every rank, every time


def test_shards_of_every_rank_cover_each_row_once_in_its_mini_batch():
    from gspo_megatron.actor.batching.batch import TrainBatch
    lengths = torch.tensor([3, 12, 4, 11, 5, 2, 12, 3, 6, 7])
    s = int(lengths.max())
    t = torch.arange(s)[None]
    batch = TrainBatch(tokens=torch.where(t < lengths[:, None], t + 1, 0), lengths=lengths,
                       loss_mask=(t >= 1) & (t < lengths[:, None]), advantages=torch.arange(10.0))
    work = [float(n) for n in lengths]
    plan = plan_shards(10, 3, 2, work)
    seen = []
    for rank in range(3):
        shard = batch.shard(rank, 3, num_mini_batches=2, work=work)
        assert shard.dp_token_imbalance == max(token_imbalance(lengths.tolist(), p) for p in plan)
        for j, mini in enumerate(shard.mini_batches()):
            assert mini.global_rows.tolist() == plan[j][rank]
            assert mini.advantages.tolist() == [float(i) for i in plan[j][rank]]
            assert mini.lengths.tolist() == lengths[plan[j][rank]].tolist()
            seen += mini.global_rows.tolist()
    assert sorted(seen) == list(range(10))
    with pytest.raises(ValueError, match="work has 3 entries for 10 rows"):
        batch.shard(0, 3, work=[1.0, 2.0, 3.0])


def test_the_setting_is_checked():
    from gspo_megatron.actor.settings import MicroBatchSettings
    with pytest.raises(ValueError, match="dp_balance='bytes': expected one of"):
        MicroBatchSettings(dp_balance="bytes")
