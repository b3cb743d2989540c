"""The estimators' arithmetic: group statistics of the scores, each group estimator's baseline and
scale (the functions ESTIMATORS names), and the return-to-go of per-token rewards. Pure torch.

A group's statistics may need rows held by other data-parallel ranks (the KL in the reward is
known only where the reference log-probs are): `GroupStats.group_sum` reduces a per-row value into
per-group sums with `all_reduce` (the caller's all-reduce over its data-parallel group, on the
group's device), so every rank computes the same baselines, in float64.
Sized at the paper's batch: 8,192 rows in 512 groups, a few [groups] vectors.
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import Callable

import torch

# all_reduce(tensor, op) -> the tensor reduced over the ranks holding the batch's rows ("sum" or
# "max"); None: one process holds them all.
AllReduce = Callable[[torch.Tensor, str], torch.Tensor]

GROUP_STD_EPS = 1e-6  # added to grpo's std (GSPO Eq. 6, verl, ROLL and slime alike)


@dataclass
class GroupStats:
    """The groups of a batch of rows, some of them (with all_reduce) on other ranks."""

    scores: torch.Tensor      # [n] float64, this rank's rows
    groups: torch.Tensor      # [n] long, each row's group index in the whole batch
    num_groups: int
    trained: torch.Tensor     # [n] float64, each row's trained tokens L_i
    all_reduce: AllReduce | None = None  # over the ranks holding the other rows, or None

    def group_sum(self, per_row: torch.Tensor) -> torch.Tensor:
        """[num_groups] sums of a per-row value over each group's rows, on every rank."""
        out = torch.zeros(self.num_groups, dtype=torch.float64).index_add_(0, self.groups, per_row.double())
        return out if self.all_reduce is None else self.all_reduce(out, "sum")

    def group_extremes(self, per_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([num_groups] max, [num_groups] min) of a per-row value over each group's rows."""
        inf = torch.full((2, self.num_groups), float("-inf"), dtype=torch.float64)
        both = torch.stack([per_row.double(), -per_row.double()])
        out = inf.scatter_reduce(1, self.groups.expand(2, -1), both, reduce="amax")
        if self.all_reduce is not None:
            out = self.all_reduce(out, "max")
        return out[0], -out[1]

    @property
    def count(self) -> torch.Tensor:
        """[n] the size of each row's group."""
        return self.group_sum(torch.ones_like(self.scores))[self.groups]

    @property
    def mean(self) -> torch.Tensor:
        """[n] the mean score of each row's group."""
        return (self.group_sum(self.scores) / self.group_sum(torch.ones_like(self.scores)).clamp(min=1))[self.groups]

    def std(self, unbiased: bool) -> torch.Tensor:
        """[n] the std of each row's group's scores (two passes: the mean first)."""
        n = self.group_sum(torch.ones_like(self.scores))
        mean = self.group_sum(self.scores) / n.clamp(min=1)
        square = self.group_sum((self.scores - mean[self.groups]).square())
        var = square / (n - 1 if unbiased else n).clamp(min=1)
        return var.sqrt()[self.groups]

    @property
    def all_equal(self) -> torch.Tensor:
        """[n] bool: every score of the row's group is the same (its advantages are exactly 0)."""
        hi, lo = self.group_extremes(self.scores)
        return (hi == lo)[self.groups]


# The group estimators of ESTIMATORS (table.py): fn(stats, settings) -> (baseline, scale) per row,
# settings the row's own (table.GroupStd for grpo) or None.
def group_mean_std(stats: GroupStats, settings: object = None) -> tuple[torch.Tensor, torch.Tensor]:
    """grpo: baseline the group mean, scale its std + 1e-6 (population, or with group_std unbiased
    Bessel's correction as torch.std: verl, ROLL, slime)."""
    unbiased = getattr(settings, "group_std", "population") == "unbiased"
    return stats.mean, stats.std(unbiased) + GROUP_STD_EPS


def group_mean(stats: GroupStats, settings: object = None) -> tuple[torch.Tensor, torch.Tensor]:
    """dr_grpo and reinforce_plus_plus_baseline: baseline the group mean, no scale."""
    return stats.mean, torch.ones_like(stats.scores)


def leave_one_out(stats: GroupStats, settings: object = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rloo: baseline the mean of the group's other scores (0 in a group of one, as verl)."""
    n = stats.count
    others = (stats.group_sum(stats.scores)[stats.groups] - stats.scores) / (n - 1).clamp(min=1)
    return torch.where(n > 1, others, torch.zeros_like(others)), torch.ones_like(stats.scores)


def group_advantages_of(stats: GroupStats, baseline: torch.Tensor, scale: torch.Tensor,
                        values: torch.Tensor | None = None) -> torch.Tensor:
    """(values - b_i) / d_i, values the scores (one per row) or any per-row-indexed value (turn
    returns); exactly 0 in a group whose scores are all equal (it teaches nothing, never NaN)."""
    values = stats.scores if values is None else values
    adv = (values - baseline) / scale
    return torch.where(stats.all_equal, torch.zeros_like(adv), adv)


def returns_to_go(token_rewards: torch.Tensor, lengths: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{t' >= t} gamma^(t' - t) r_t' within each packed row -> [T] (float64). Positions
    count whatever they hold (prompt, environment tokens): the discount is per position, as ROLL's
    compute_reinforce_return over its padded rows."""
    r = token_rewards.double()
    if gamma == 1.0:  # a suffix sum per row: the total minus the exclusive prefix
        offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
        prefix = torch.cat([r.new_zeros(1), torch.cumsum(r, 0)])
        row_end = torch.repeat_interleave(prefix[offsets[1:]], lengths)
        return row_end - prefix[:-1]
    # A backward scan over positions, vectorised over rows padded in chunks (a chunk of 256 rows of
    # 32k tokens is 64 MB in float64): as verl's and ROLL's loops over their padded batches.
    out = torch.empty_like(r)
    offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
    for first in range(0, lengths.numel(), _SCAN_ROWS):
        rows = torch.arange(first, min(first + _SCAN_ROWS, lengths.numel()))
        n = lengths[rows]
        width = int(n.max()) if n.numel() else 0
        inside = torch.arange(width)[None, :] < n[:, None]  # [rows, width]
        where = offsets[rows][:, None] + torch.arange(width)[None, :]
        padded = torch.zeros(len(rows), width, dtype=torch.float64)
        padded[inside] = r[where[inside]]
        acc = torch.zeros(len(rows), dtype=torch.float64)
        for t in range(width - 1, -1, -1):
            acc = padded[:, t] + gamma * acc
            padded[:, t] = acc
        out[where[inside]] = padded[inside]
    return out


_SCAN_ROWS = 256
