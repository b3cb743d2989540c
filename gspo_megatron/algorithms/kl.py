"""KL penalty against a reference policy (off by default: the GSPO paper omits it), as a loss term
(loss.kl_coef) or in the reward (loss.kl_in_reward_coef, advantage/pipeline.py)."""
from __future__ import annotations

import torch

from .registry import KL_ESTIMATORS
from .rows import LOG_RATIO_CLAMP, Rows

# low_var_kl's bound (verl kl_penalty_forward, slime compute_approx_kl, ROLL compute_approx_kl).
LOW_VAR_KL_BOUND = 10.0


def token_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta (Schulman, "Approximating
    KL divergence", 2020), with d = log pi_theta - log pi_ref:

    k1 = d (unbiased, can be negative); k2 = d^2 / 2; k3 = exp(-d) + d - 1 (unbiased, >= 0, lower
    variance; -d clamped to +-20 before the exp); low_var_kl = k3 clamped to [-10, 10] (the peers'
    clamped form: its gradient is 0 beyond); abs = |d|.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    log_ratio = log_probs - ref_log_probs.detach()
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "abs":
        return log_ratio.abs()
    r = (-log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    k3 = torch.expm1(r) - r
    return k3.clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND) if estimator == "low_var_kl" else k3


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, loss_mask: torch.Tensor,
               estimator: str = "k3") -> torch.Tensor:
    """Per-row masked mean of the per-token KL estimate -> `[b]` (0 for rows with no trainable token).

    Differentiable w.r.t. `log_probs`; masked positions get zero gradient whatever they hold.
    """
    if not (log_probs.shape == ref_log_probs.shape == loss_mask.shape) or log_probs.dim() != 2:
        raise ValueError(f"log_probs {tuple(log_probs.shape)}, ref_log_probs {tuple(ref_log_probs.shape)} "
                         f"and loss_mask {tuple(loss_mask.shape)} must all be the same [b, s]")
    mask = loss_mask != 0  # bool or 0/1 masks alike
    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    lp = torch.where(mask, log_probs.to(dtype), 0)
    ref = torch.where(mask, ref_log_probs.to(dtype), 0)
    per_token = torch.where(mask, token_kl(lp, ref, estimator), 0)
    return per_token.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1).to(dtype)


def rows_kl(rows: Rows, ref_log_probs: torch.Tensor | None, estimator: str) -> torch.Tensor | None:
    """The per-token KL estimate `[b, s]` of a prepared batch (0 at untrained positions), or None
    without a reference policy: the losses aggregate it like their own terms (rows.finish_loss),
    under context parallelism over the whole rows (rows.py)."""
    if ref_log_probs is None:
        return None
    ref = torch.where(rows.mask, ref_log_probs.detach().to(rows.log_probs.dtype), 0)
    return torch.where(rows.mask, token_kl(rows.log_probs, ref, estimator), 0)
