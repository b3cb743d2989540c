"""Rewards -> advantages of one rollout batch, in the order the peers apply them (ROLL's
reward_postprocess, compute_token_reward, compute_advantage; verl's apply_kl_penalty and
compute_advantage):

    1. reward norm, reward clip        shape_rewards (the driver: every reward is there)
    2. KL in the reward                r_t = R on the last trained token - beta KL_t (clipped again)
    3. the estimator                   group: (S_i - b_i) / d_i, S_i = sum_t r_t; return: G_t
    4. whitening, advantage clip       over the trained tokens of the whole batch

    adv = batch_advantages(settings, shaped, rows)                     # the driver, [n] or [T]
    adv = batch_advantages(settings, shaped, rows, kl=kl, all_reduce=f)  # KL in the reward: each
                                                                         # DP rank's last stage

With the KL in the reward, steps 2-4 run where the reference log-probs are (the last pipeline stage
of every data-parallel rank, each with its own rows): the group sums and the whitening statistics
are all-reduced over the data-parallel group (`all_reduce`), so every rank uses the same baselines and one mean and variance
for the batch, and the result equals one process's on the whole batch (tests/algorithms/
test_advantage_layouts.py). Sized at the paper's batch: [groups] and [3] all-reduces, per-token
work on a rank's own rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .estimators import AllReduce, GroupStats, group_advantages_of, returns_to_go
from .shaping import RunningMoments, normalize_rewards, whiten
from .table import AdvantageSettings


@dataclass
class BatchRows:
    """The rows advantages are computed for (packed, as the driver's TrainBatch): this rank's."""

    lengths: torch.Tensor      # [n] long, tokens per row (prompt + response)
    loss_mask: torch.Tensor    # [T] bool, trained tokens (TrainBatch's target alignment)
    groups: torch.Tensor       # [n] long, the row's prompt group in the whole batch
    num_groups: int            # groups in the whole batch (over every DP rank)

    @property
    def trained(self) -> torch.Tensor:
        """[n] L_i, trained tokens per row (float64)."""
        return _row_sums(self.loss_mask.double(), self.lengths)

    def last_trained(self) -> torch.Tensor:
        """[T] bool: each row's last trained token (where its outcome reward sits)."""
        marked = torch.where(self.loss_mask, torch.arange(self.loss_mask.numel()), -1)
        row = torch.repeat_interleave(torch.arange(self.lengths.numel()), self.lengths)
        last = torch.full((self.lengths.numel(),), -1, dtype=torch.long).scatter_reduce(
            0, row, marked, reduce="amax")
        out = torch.zeros_like(self.loss_mask)
        out[last[last >= 0]] = True
        return out


def _row_sums(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    c = torch.cat([values.new_zeros(1), torch.cumsum(values, 0)])
    o = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
    return c[o[1:]] - c[o[:-1]]


def shape_rewards(settings: AdvantageSettings, rewards: torch.Tensor, group_size: int,
                  running: RunningMoments | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Step 1 on the batch's rewards `[n]` (float64 out) and its metric: the fraction clipped."""
    r = normalize_rewards(rewards, group_size, settings.reward_norm_mean, settings.reward_norm_std, running)
    metrics = {}
    if settings.reward_clip is not None:
        c = settings.reward_clip
        metrics["reward_clip_fraction"] = float((r.abs() > c).double().mean()) if r.numel() else 0.0
        r = r.clamp(-c, c)
    return r, metrics


def batch_advantages(settings: AdvantageSettings, rewards: torch.Tensor, rows: BatchRows, *,
                     token_rewards: torch.Tensor | None = None, turn_returns: torch.Tensor | None = None,
                     kl: torch.Tensor | None = None, all_reduce: AllReduce | None = None,
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """Steps 2-4: this rank's advantages, `[n]` (one per row) or `[T]` (per token), float64.

    rewards: `[n]` shaped rewards R_i. token_rewards `[T]`: where the rewards sit (multi-turn
    per-turn credit: each turn's at its last token); None: R_i on the row's last trained token.
    turn_returns `[T]`: a group estimator's per-turn credit, each token's turn return (the group's
    baseline and scale come from the rows' scores, `rewards`). kl `[T]`: the per-token KL of pi_old
    from the reference (the KL in the reward). all_reduce: the reduction over the ranks holding the
    rest of the batch's rows (module docstring); None: these are all of them.
    """
    spec = settings.estimator
    R = rewards.double()
    beta_kl = None  # beta * KL_t on trained tokens: the KL's share of each token's reward
    if kl is not None:
        beta_kl = settings.kl_in_reward_coef * torch.where(rows.loss_mask, kl.double(), 0.0)
    per_token = turn_returns is not None or (spec.kind == "return" and (
        settings.gamma < 1 or kl is not None or token_rewards is not None))
    if spec.kind == "group":
        # verl: the score is the sum of the token rewards, R_i - beta sum_t KL_t (R_i whole even
        # for a row without a trained token: it still counts in its group's statistics)
        scores = R if beta_kl is None else R - _row_sums(beta_kl, rows.lengths)
        stats = GroupStats(scores, rows.groups, rows.num_groups, rows.trained, all_reduce)
        estimate = spec.baseline_and_scale()
        if estimate is None:
            raise ValueError(f"advantage estimator {spec.name!r} of kind 'group' names no function")
        baseline, scale = estimate(stats, settings.estimator_settings)
        if turn_returns is None:
            adv = group_advantages_of(stats, baseline, scale)
        else:  # per-turn credit: each token's turn return against its row's baseline and scale
            index = torch.repeat_interleave(torch.arange(R.numel()), rows.lengths)
            adv = (turn_returns.double() - baseline[index]) / scale[index]
            adv = torch.where(stats.all_equal[index], 0.0, adv)
    elif per_token:  # the return-to-go of the token rewards (ROLL compute_token_reward + returns)
        r = token_rewards.double() if token_rewards is not None else \
            torch.where(rows.last_trained(), torch.repeat_interleave(R, rows.lengths), 0.0)
        if beta_kl is not None:
            r = r - beta_kl
            if settings.reward_clip is not None:  # ROLL clips the token rewards once more
                r = r.clamp(-settings.reward_clip, settings.reward_clip)
        adv = returns_to_go(r, rows.lengths, settings.gamma)
    else:  # gamma 1, one reward at the end: every trained token's return is the row's reward
        adv = R
    metrics = {}
    if settings.whiten_advantages or spec.whitens:
        weights = rows.loss_mask.double() if per_token else rows.trained
        adv = whiten(adv, weights, all_reduce)
    if settings.advantage_clip is not None:
        c = settings.advantage_clip
        weights = rows.loss_mask.double() if per_token else rows.trained  # per trained token
        metrics["advantage_clip_fraction"] = float(((adv.abs() > c) * weights).sum() / weights.sum().clamp(min=1))
        adv = adv.clamp(-c, c)
    return adv, metrics
