"""KL penalty against a reference policy (off by default: the GSPO paper omits it)."""
from __future__ import annotations

import torch

from .registry import KL_ESTIMATORS
from .rows import LOG_RATIO_CLAMP, Rows


def token_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta (Schulman's k1/k3).

    k1 = log pi_theta - log pi_ref (unbiased, can be negative);
    k3 = exp(r) - r - 1 with r = log pi_ref - log pi_theta (unbiased, >= 0, lower variance).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    log_ratio = log_probs - ref_log_probs.detach()
    if estimator == "k1":
        return log_ratio
    r = (-log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.expm1(r) - r


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
    """`kl_penalty` of a prepared batch, or None without a reference policy (the losses' KL term);
    under context parallelism over the whole rows (rows.py)."""
    if ref_log_probs is None:
        return None
    # kl_penalty's masked row mean, with the row sums over the CP group (rows.py)
    ref = torch.where(rows.mask, ref_log_probs.detach().to(rows.log_probs.dtype), 0)
    return rows.mean(token_kl(rows.log_probs, ref, estimator))
