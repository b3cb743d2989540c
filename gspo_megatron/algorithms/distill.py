"""On-policy distillation's per-token advantage (docs/algorithm.md, "On-policy distillation").

    A[i, t] = reward_coef * A_group[i] + coef * (log pi_teacher(y_t) - log pi_old(y_t))

on the tokens the student generated (loss_mask), 0 elsewhere: the group-relative task advantage
(GSPO Eq. 6) plus the negative per-token reverse KL of the student's sampling policy from the
teacher's, both constants of the update (no gradient flows through them). Trained with GSPO-token
(Eqs. 13-14): the sequence ratio and its clipping stay GSPO's, each token weighs in with its own
advantage. Pure torch.
"""
from __future__ import annotations

import torch


def distillation_advantages(advantages: torch.Tensor, old_log_probs: torch.Tensor,
                            teacher_log_probs: torch.Tensor, loss_mask: torch.Tensor, *,
                            coef: float, reward_coef: float) -> torch.Tensor:
    """Per-token advantages, shaped as old_log_probs: [b, s] (a padded batch) or [T] (packed).
    advantages: per token like old_log_probs (e.g. turn credit; TrainBatch.token_advantages()) or,
    padded, [b] (sequence); old_log_probs, teacher_log_probs, loss_mask: at target positions."""
    if old_log_probs.shape != teacher_log_probs.shape or old_log_probs.shape != loss_mask.shape:
        raise ValueError(f"old {tuple(old_log_probs.shape)}, teacher {tuple(teacher_log_probs.shape)} and "
                         f"loss_mask {tuple(loss_mask.shape)} log-probs must have one shape")
    task = advantages if advantages.shape == old_log_probs.shape else advantages[:, None].expand_as(old_log_probs)
    term = (teacher_log_probs - old_log_probs).detach()
    out = reward_coef * task.to(old_log_probs.dtype) + coef * term
    return torch.where(loss_mask.bool(), out, torch.zeros_like(out))


def reverse_kl(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
               loss_mask: torch.Tensor) -> float:
    """Mean over the student's tokens of log pi_student(y_t) - log pi_teacher(y_t): the per-token
    estimate of KL(pi_student || pi_teacher) on the student's own samples (0 when they agree)."""
    mask = loss_mask.bool()
    n = int(mask.sum())
    return float((student_log_probs - teacher_log_probs)[mask].sum() / n) if n else 0.0
