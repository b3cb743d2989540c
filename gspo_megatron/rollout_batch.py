"""Samples -> the actor's rows: a rollout batch's TrainBatch (driver, rank 0), and the supervised
warm start's. Rows are prompt + response, right-padded; per-token fields sit at the position of the
token they belong to (TrainBatch's target alignment).
"""
from __future__ import annotations

import torch

from gspo_megatron.actor.batch import TrainBatch
from gspo_megatron.algorithms.advantages import group_advantages
from gspo_megatron.episodes import token_advantages
from rollout.sample import Sample


def _version_number(label: str) -> int:
    """The trainer labels weight versions with step counters ("0", "1", ...); anything else (the
    server's initial "default", an environment token's "") is -1."""
    return int(label) if label.isdigit() else -1


def samples_to_batch(groups: list[list[Sample]], group_size: int,
                     turn_discount: float | None = None) -> TrainBatch:
    """Rows = prompt + response of each sample, right-padded; loss_mask / rollout log-probs /
    weight versions at the position of the token they belong to (TrainBatch's target alignment);
    advantages group-normalised (GSPO Eq. 6) from the rewards, or, with `turn_discount` (per-turn
    credit of multi-turn episodes, for gspo_token), per token from the per-turn rewards
    (episodes.token_advantages)."""
    samples = [s for g in groups for s in g]
    width = max(len(s.tokens) for s in samples)
    if turn_discount is None:
        rewards = torch.tensor([float(s.reward) for s in samples], dtype=torch.float64)
        advantages = group_advantages(rewards, group_size).float()  # [b]
    else:
        advantages = token_advantages(samples, group_size, width, turn_discount)  # [b, s]
    b = len(samples)
    tokens = torch.zeros(b, width, dtype=torch.long)
    loss_mask = torch.zeros(b, width, dtype=torch.bool)
    logp = torch.zeros(b, width, dtype=torch.float32)
    versions = torch.full((b, width), -1, dtype=torch.long)
    lengths = torch.zeros(b, dtype=torch.long)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        tokens[i, :p + r] = torch.tensor(s.tokens, dtype=torch.long)
        loss_mask[i, p:p + r] = torch.tensor(s.loss_mask, dtype=torch.bool)
        logp[i, p:p + r] = torch.tensor(s.logprobs, dtype=torch.float32)
        versions[i, p:p + r] = torch.tensor([_version_number(v) for v in s.weight_versions],
                                            dtype=torch.long)
        lengths[i] = p + r
    teacher = None
    if any(s.teacher_logprobs is not None for s in samples):  # on-policy distillation
        teacher = torch.zeros(b, width, dtype=torch.float32)
        for i, s in enumerate(samples):
            p = len(s.prompt_ids)
            teacher[i, p:p + len(s.response_ids)] = torch.tensor(s.teacher_logprobs, dtype=torch.float32)
    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=loss_mask, advantages=advantages,
                      rollout_log_probs=logp, weight_versions=versions,
                      routed_experts=routed_experts(samples, width), teacher_log_probs=teacher)


def routed_experts(samples: list[Sample], width: int) -> torch.Tensor | None:
    """The engine's routing of each row ([b, width, layers, k] int16, -1 where there is none), or
    None when no sample carries any (rollout without moe.engine_routing)."""
    have = [s.routed_experts for s in samples if s.routed_experts is not None]
    if not have:
        return None
    shape = have[0].shape[1:]
    out = torch.full((len(samples), width, *shape), -1, dtype=torch.int16)
    for i, s in enumerate(samples):
        if s.routed_experts is None:
            continue
        if tuple(s.routed_experts.shape) != (len(s.tokens), *shape):
            raise ValueError(f"sample {s.group_id}/{s.index}: routed experts of shape "
                             f"{tuple(s.routed_experts.shape)}, expected ({len(s.tokens)}, {shape})")
        out[i, :len(s.tokens)] = torch.from_numpy(s.routed_experts.astype("int16"))
    return out


def policy_lag(batch: TrainBatch, current_version: int) -> float:
    """The largest number of weight updates between the policy that sampled a trained token and
    the current one (0: fully on-policy; > 0 only with partial rollouts)."""
    sampled = batch.weight_versions[batch.loss_mask & (batch.weight_versions >= 0)]
    return float(current_version - int(sampled.min())) if sampled.numel() else 0.0


def sft_batch(examples: list[tuple]) -> TrainBatch:
    """Prompt + answer rows with loss on the answer tokens (the "ce" loss of the actor). An
    example is (prompt ids, answer ids) or (prompt ids, answer ids, answer loss mask): an episode's
    environment tokens are in the row but not trained."""
    width = max(len(e[0]) + len(e[1]) for e in examples)
    b = len(examples)
    tokens = torch.zeros(b, width, dtype=torch.long)
    loss_mask = torch.zeros(b, width, dtype=torch.bool)
    lengths = torch.zeros(b, dtype=torch.long)
    for i, e in enumerate(examples):
        p, a = e[0], e[1]
        mask = e[2] if len(e) > 2 else [1] * len(a)
        tokens[i, :len(p) + len(a)] = torch.tensor(p + a)
        loss_mask[i, len(p):len(p) + len(a)] = torch.tensor(mask, dtype=torch.bool)
        lengths[i] = len(p) + len(a)
    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=loss_mask,
                      advantages=torch.zeros(b))
