"""KL penalty against a reference policy (off by default: the GSPO paper omits it), as a loss term
(loss.kl_coef) or in the reward (loss.kl_in_reward_coef, advantage/pipeline.py)."""
from __future__ import annotations

import torch

from .rows import LOG_RATIO_CLAMP, Rows
from .terms import KL_ESTIMATORS

# low_var_kl's bound (verl kl_penalty_forward, slime compute_approx_kl, ROLL compute_approx_kl).
LOW_VAR_KL_BOUND = 10.0


# The estimators of the KL_ESTIMATORS table (terms.py), in d = log pi_theta - log pi_ref.
def k1(d: torch.Tensor) -> torch.Tensor:
    return d


def k2(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d.square()


def k3(d: torch.Tensor) -> torch.Tensor:
    r = (-d).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # exp of at most e^20: finite in fp32/bf16
    return torch.expm1(r) - r


def low_var_kl(d: torch.Tensor) -> torch.Tensor:
    return k3(d).clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)


def abs_kl(d: torch.Tensor) -> torch.Tensor:
    return d.abs()


def token_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta: the row `estimator` of
    KL_ESTIMATORS (terms.py; Schulman, "Approximating KL divergence", 2020) at d = log pi_theta -
    log pi_ref (the reference a constant)."""
    return KL_ESTIMATORS.row(estimator, "kl_estimator").estimate()(log_probs - ref_log_probs.detach())


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
