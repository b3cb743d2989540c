"""Samples -> the actor's rows: a rollout batch's TrainBatch (driver, rank 0; packed). Rows are prompt + response; per-token fields sit at the position
of the token they belong to (TrainBatch's target alignment). The advantages come from the rewards
through the loss section's estimator (algorithms/advantage/pipeline.py), here with every row at
hand, or on the ranks after the reference log-probs when the KL is in the reward.
"""
from __future__ import annotations

import torch

from gspo_megatron.actor.batching.batch import ROUTE_NONE_U8, TrainBatch, compact_routes
from gspo_megatron.algorithms.advantage.pipeline import BatchRows, batch_advantages, shape_rewards
from gspo_megatron.algorithms.advantage.shaping import RunningMoments
from gspo_megatron.algorithms.advantage.table import AdvantageSettings
from gspo_megatron.driver.turn_credit import turn_batch_advantages
from rollout.generation.sample import Sample


def _version_number(label: str) -> int:
    """The trainer labels weight versions with step counters ("0", "1", ...); anything else (the
    server's initial "default", an environment token's "") is -1."""
    return int(label) if label.isdigit() else -1


def samples_to_batch(groups: list[list[Sample]], group_size: int,
                     turn_discount: float | None = None, *, advantage: AdvantageSettings | None = None,
                     running: RunningMoments | None = None, metrics: dict[str, float] | None = None) -> TrainBatch:
    """The rows of the samples (prompt + response each), packed (TrainBatch's packed form: only
    real tokens, no padded batch on the driver); loss_mask / rollout log-probs / weight versions at
    the position of the token they belong to (TrainBatch's target alignment); the engine's routes
    compact (uint8 up to 255 experts).

    Advantages: `advantage`'s estimator (default: grpo, GSPO Eq. 6) on the rewards, one per row, or,
    with `turn_discount` (per-turn credit of multi-turn episodes) or a per-token estimator, one per
    token. `rewards` holds the shaped rewards (reward norm and clip; `running` keeps the running
    norm's statistics); with the KL in the reward the advantages are left at 0 for the last
    pipeline stage to compute (actor/reward_kl.py). `metrics`, when given, receives the shaping's
    clip fractions."""
    settings = advantage or AdvantageSettings()
    samples = [s for g in groups for s in g]
    lengths = torch.tensor([len(s.prompt_ids) + len(s.response_ids) for s in samples], dtype=torch.long)
    total = int(lengths.sum())
    tokens = torch.zeros(total, dtype=torch.long)
    loss_mask = torch.zeros(total, dtype=torch.bool)
    logp = torch.zeros(total, dtype=torch.float32)
    versions = torch.full((total,), -1, dtype=torch.long)
    teacher = None
    if any(s.teacher_logprobs is not None for s in samples):  # on-policy distillation
        teacher = torch.zeros(total, dtype=torch.float32)
    start = 0
    for s in samples:
        p, r = len(s.prompt_ids), len(s.response_ids)
        tokens[start:start + p + r] = torch.tensor(s.tokens, dtype=torch.long)
        response = slice(start + p, start + p + r)
        loss_mask[response] = torch.tensor(s.loss_mask, dtype=torch.bool)
        logp[response] = torch.tensor(s.logprobs, dtype=torch.float32)
        versions[response] = torch.tensor([_version_number(v) for v in s.weight_versions], dtype=torch.long)
        if teacher is not None and s.teacher_logprobs is not None:
            teacher[response] = torch.tensor(s.teacher_logprobs, dtype=torch.float32)
        start += p + r
    rewards, shaping = shape_rewards(settings, torch.tensor([s.score for s in samples],
                                                            dtype=torch.float64), group_size, running)
    rows = BatchRows(lengths, loss_mask, torch.arange(len(samples)) // group_size, len(samples) // group_size)
    if settings.kl_in_reward:  # finished on the last pipeline stage, after the reference log-probs
        advantages = torch.zeros(len(samples), dtype=torch.float32)
    elif turn_discount is not None:
        advantages, m = turn_batch_advantages(settings, samples, rows, turn_discount)
        shaping.update(m)
    else:
        advantages, m = batch_advantages(settings, rewards, rows)
        shaping.update(m)
    if metrics is not None:
        metrics.update(shaping)
    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=loss_mask, advantages=advantages.float(),
                      rewards=rewards.float(), rollout_log_probs=logp, weight_versions=versions,
                      routed_experts=routed_experts(samples, total), teacher_log_probs=teacher)


def routed_experts(samples: list[Sample], total: int) -> torch.Tensor | None:
    """The engine's routing of the packed rows ([T, layers, k]: uint8 with 255 where there is
    none while expert ids fit a byte, else int16 with -1), or None when no sample carries any
    (rollout without moe.engine_routing)."""
    have = [s.routed_experts for s in samples if s.routed_experts is not None]
    if not have:
        return None
    shape = have[0].shape[1:]
    wide = any(a.size and int(a.max()) >= ROUTE_NONE_U8 for a in have)
    out = torch.full((total, *shape), -1 if wide else ROUTE_NONE_U8,
                     dtype=torch.int16 if wide else torch.uint8)
    start = 0
    for s in samples:
        n = len(s.tokens)
        if s.routed_experts is not None:
            if tuple(s.routed_experts.shape) != (n, *shape):
                raise ValueError(f"sample {s.group_id}/{s.index}: routed experts of shape "
                                 f"{tuple(s.routed_experts.shape)}, expected ({n}, {shape})")
            routes = torch.from_numpy(s.routed_experts.astype("int16"))
            out[start:start + n] = routes if wide else compact_routes(routes)
        start += n
    return out


def policy_lag(batch: TrainBatch, current_version: int) -> float:
    """The largest number of weight updates between the policy that sampled a trained token and
    the current one (0: fully on-policy; > 0 only with partial rollouts)."""
    versions = batch.weight_versions
    if versions is None:
        raise ValueError("the batch carries no weight_versions: its samples' versions were not recorded")
    sampled = versions[batch.loss_mask & (versions >= 0)]
    return float(current_version - int(sampled.min())) if sampled.numel() else 0.0
