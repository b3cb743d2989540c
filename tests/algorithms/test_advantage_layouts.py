"""The advantages and the loss aggregations split as the trainer splits them, on real gloo ranks,
against one process on the whole batch (fp64, 1e-12):

- the KL in the reward: each DP rank holds some rows of every group (uneven, one rank none at all)
  and finishes its advantages with group sums and whitening statistics all-reduced
  (algorithms/advantage/pipeline.py): every estimator equals one process's;
- each aggregation (token-mean, seq-mean-token-sum, seq-mean-token-sum-norm, seq-mean-token-mean)
  of grpo, with the dual clip and the KL term, on rows split over 2 context-parallel ranks (the
  zig-zag chunks): the loss and every token's gradient equal one process's.
The actor's layouts (DP, PP, TP, token-budget micro-batches) per aggregation: tests/actor/
test_actor_aggregation.py."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from distributed import run_distributed

pytestmark = pytest.mark.slow

F64 = torch.float64
ESTIMATOR_CASES: dict[str, dict[str, Any]] = {
    "grpo": dict(advantage_estimator="grpo", estimator_args={"group_std": "unbiased"}, kl_in_reward_coef=0.3),
    "rloo": dict(advantage_estimator="rloo", kl_in_reward_coef=0.3, whiten_advantages=True),
    "rf_pp_baseline": dict(advantage_estimator="reinforce_plus_plus_baseline", kl_in_reward_coef=0.3,
                           kl_in_reward_estimator="low_var_kl"),
    "rf_pp_gamma": dict(advantage_estimator="reinforce_plus_plus", kl_in_reward_coef=0.3, estimator_args={"gamma": 0.9}),
    "roll_reinforce": dict(advantage_estimator="reinforce", kl_in_reward_coef=0.3, whiten_advantages=True,
                           reward_clip=0.7, advantage_clip=1.0, kl_in_reward_estimator="k2"),
}


def _batch(seed: int = 0, groups: int = 5, group_size: int = 4):
    g = torch.Generator().manual_seed(seed)
    n = groups * group_size
    lengths = torch.randint(3, 12, (n,), generator=g)
    rows = []
    for i, length in enumerate(lengths.tolist()):
        prompt = int(torch.randint(1, 3, (1,), generator=g))
        m = torch.zeros(length, dtype=torch.bool)
        m[prompt:] = torch.rand(length - prompt, generator=g) > 0.2
        rows.append(m)
    rows[3][:] = False  # a row without a trained token
    mask = torch.cat(rows)
    rewards = torch.randn(n, generator=g, dtype=F64)
    rewards[:group_size] = 1.0  # a group of equal rewards
    kl = torch.rand(int(lengths.sum()), generator=g, dtype=F64)
    return lengths, mask, rewards, kl, group_size


def _shares(n: int, world: int) -> list[list[int]]:
    """Uneven, interleaved rows per rank (every group split over ranks); the last rank none."""
    if world == 1:
        return [list(range(n))]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(7)).tolist()
    cut = [0, n // 3, n]
    return [sorted(order[cut[r]:cut[r + 1]]) for r in range(world - 1)] + [[]]


def _advantage_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from gspo_megatron.algorithms.advantage.pipeline import BatchRows, batch_advantages
    from gspo_megatron.algorithms.advantage.table import AdvantageSettings

    def all_reduce(t, op):
        out = t.clone()
        dist.all_reduce(out, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return out

    lengths, mask, rewards, kl, group_size = _batch()
    n = lengths.numel()
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
    mine = torch.tensor(_shares(n, world)[rank], dtype=torch.long)
    tokens = torch.cat([torch.arange(int(offsets[i]), int(offsets[i + 1])) for i in mine.tolist()]) \
        if mine.numel() else torch.zeros(0, dtype=torch.long)
    out = {}
    for name, kw in ESTIMATOR_CASES.items():
        s = AdvantageSettings(**kw)
        full, _ = batch_advantages(s, rewards, BatchRows(lengths, mask, torch.arange(n) // group_size, n // group_size),
                                   kl=kl)
        rows = BatchRows(lengths[mine], mask[tokens], mine // group_size, n // group_size)
        local, _ = batch_advantages(s, rewards[mine], rows, kl=kl[tokens], all_reduce=all_reduce)
        want = full[tokens] if full.numel() != n else full[mine]
        out[name] = (float((local - want).abs().max()) if local.numel() else 0.0, local.numel(),
                     float(want.abs().max()) if want.numel() else 0.0)
    return out


def test_kl_in_the_reward_over_three_uneven_dp_ranks_equals_one_process():
    results = run_distributed(_advantage_worker, 3, timeout=120)
    for name in ESTIMATOR_CASES:
        diffs = [r[name] for r in results]
        assert all(d <= 1e-12 for d, _, _ in diffs), (name, diffs)
        assert diffs[0][1] > 0 and diffs[1][1] > 0 and diffs[2][1] == 0  # the last rank holds no row
        assert max(big for _, _, big in diffs) > 0.1, name  # not all zeros


def _batch_for_loss(seed: int = 0, b: int = 6, s: int = 16):
    g = torch.Generator().manual_seed(seed)
    old = -2 * torch.rand(b, s, generator=g, dtype=F64)
    lp = old + 0.6 * torch.randn(b, s, generator=g, dtype=F64)
    lp[1, :] = old[1, :] + 1.5  # ratios past the dual clip's 3 on a negative advantage
    mask = torch.rand(b, s, generator=g) < 0.7
    mask[:, 0] = False
    mask[4] = False          # no trained token
    mask[5] = False
    mask[5, 2:4] = True      # trained only in CP rank 0's first chunk
    adv = torch.randn(b, s, generator=g, dtype=F64)
    adv[1] = -1.0
    ref = old + 0.3 * torch.randn(b, s, generator=g, dtype=F64)
    return lp, old, adv, mask, ref


MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]  # AGGREGATIONS' rows


def _cp_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from gspo_megatron.algorithms import grpo_loss
    from gspo_megatron.algorithms.terms import Aggregation
    from gspo_megatron.parallel import context

    lp, old, adv, mask, ref = _batch_for_loss()
    group = dist.group.WORLD

    def cut(t):
        return context.split(t, rank, world)

    out = {}
    for mode in MODES:
        kw: dict[str, Any] = dict(eps_low=0.2, eps_high=0.27, dual_clip_c=3.0, kl_coef=0.1, kl_estimator="low_var_kl",
                                  loss_agg_mode=Aggregation.of(mode, {"token_sum_norm": 16.0} if mode.endswith("norm") else {}))
        for reduction in ("mean", "sum"):
            x = lp.clone().requires_grad_(True)
            full, _ = grpo_loss(x, old, adv, mask, ref_log_probs=ref, reduction=reduction, **kw)
            (full_grad,) = torch.autograd.grad(full, x)
            y = cut(lp).clone().requires_grad_(True)
            part, _ = grpo_loss(y, cut(old), cut(adv), cut(mask), ref_log_probs=cut(ref), reduction=reduction,
                                cp_group=group, **kw)
            (grad,) = torch.autograd.grad(part, y)
            assert group is not None
            assert group is not None
            got = context.all_gather(grad, group)
            out[(mode, reduction)] = (abs(float(part - full)), float((got - full_grad).abs().max()),
                                      float(full_grad.abs().max()))
    return out


def test_each_aggregation_over_two_cp_ranks_equals_one_process():
    results = run_distributed(_cp_worker, 2, timeout=120)
    for key in results[0]:
        for res in results:
            loss, grad, scale = res[key]
            assert loss <= 1e-12 and grad <= 1e-12 and scale > 0, (key, res[key])
