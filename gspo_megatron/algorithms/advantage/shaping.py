"""Reward shaping before the estimator, and the advantage's whitening and clip after it. Pure torch.

Reward normalisation is ROLL's (roll/utils/functionals.py reward_norm, 2025): a mean (batch,
group or running) subtracted, a std (the same kinds, Bessel-corrected) divided by with 1e-6 added;
then the clip to [-c, c] (reward_postprocess). Whitening is the peers' masked whiten (verl
verl_F.masked_whiten, ROLL masked_whiten, slime distributed_masked_whiten): over the trained tokens,
(x - mean) * rsqrt(var + 1e-8), var with Bessel's correction; here over every data-parallel rank's
rows when a group is given (one mean and one variance for the batch, as slime's all-reduce).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .estimators import AllReduce

REWARD_STD_EPS = 1e-6   # ROLL reward_norm
WHITEN_EPS = 1e-8       # inside the rsqrt: verl, ROLL, slime


@dataclass
class RunningMoments:
    """Mean and variance of every reward seen so far (ROLL's RunningMoments, after
    stable-baselines3's RunningMeanStd): the "running" normalisation's statistics, kept in the
    driver's checkpointed state."""

    mean: float = 0.0
    var: float = 1.0
    count: float = 1e-24

    @property
    def std(self) -> float:
        """Bessel-corrected, as ROLL's `std` after an update (1 before any)."""
        return (self.var * self.count / (self.count - 1)) ** 0.5 if self.count > 1 else 1.0

    def update(self, xs: torch.Tensor) -> None:
        n = xs.numel()
        if n == 0:
            return
        x = xs.double()
        batch_var, batch_mean = float(x.var(correction=0)), float(x.mean())
        delta, total = batch_mean - self.mean, self.count + n
        m2 = self.var * self.count + batch_var * n + delta * delta * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.count = total

    def to_state(self) -> dict[str, float]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    @classmethod
    def from_state(cls, state: dict[str, float] | None) -> "RunningMoments":
        return cls(**state) if state else cls()


def normalize_rewards(rewards: torch.Tensor, group_size: int, mean: str | None, std: str | None,
                      running: RunningMoments | None = None) -> torch.Tensor:
    """ROLL's reward_norm over a batch's rewards `[n]` (groups of `group_size` in order): subtract
    the batch's, the group's or the running mean (None: nothing), divide by the batch's, group's or
    running std + 1e-6 (None: nothing). The running statistics take this batch first (ROLL updates
    them before normalising). Every std is Bessel-corrected (torch.std)."""
    r = rewards.double()
    if "running" in (mean, std):
        if running is None:
            raise ValueError("running reward normalisation needs the run's RunningMoments")
        running.update(r)
    grouped = r.view(-1, group_size) if "group" in (mean, std) else None

    def stat(kind: str | None, of: str) -> torch.Tensor | float:
        if kind is None:
            return 0.0 if of == "mean" else 1.0
        if kind == "batch":
            return r.mean() if of == "mean" else r.std()
        if grouped is not None and kind == "group":
            x = grouped.mean(1, keepdim=True) if of == "mean" else grouped.std(1, keepdim=True)
            return x.expand_as(grouped).reshape(-1)
        if running is None or kind != "running":
            raise ValueError(f"reward normalisation {kind!r}: expected 'batch', 'group', 'running' or null")
        return running.mean if of == "mean" else running.std

    centred = r - stat(mean, "mean")
    return centred / (stat(std, "std") + REWARD_STD_EPS) if std is not None else centred


def whiten(values: torch.Tensor, weights: torch.Tensor, all_reduce: AllReduce | None = None) -> torch.Tensor:
    """(x - mean) * rsqrt(var + 1e-8), with mean and Bessel-corrected var of `values` weighted by
    `weights` (1 per trained token, or L_i per row for one advantage per row: the same statistics
    as over that row's tokens), summed with `all_reduce` over the ranks holding the rest of the
batch when given. Fewer than two weighted tokens:
    unchanged (the variance is undefined; ROLL skips its whitening then)."""
    x, w = values.double(), weights.double()
    first = torch.stack([(w * x).sum(), w.sum()])
    if all_reduce is not None:
        first = all_reduce(first, "sum")
    total, count = first[0], first[1]
    if float(count) < 2:
        return x
    mean = total / count
    second = (w * (x - mean).square()).sum().reshape(1)  # the second pass, as verl's masked_var
    if all_reduce is not None:
        second = all_reduce(second, "sum")
    var = second[0] / (count - 1)
    return (x - mean) * torch.rsqrt(var + WHITEN_EPS)
