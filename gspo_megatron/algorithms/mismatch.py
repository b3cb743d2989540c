"""Corrections for the train/inference mismatch: pi_old recomputed by megatron, samples drawn by
SGLang (pi_eng). Pure torch; the losses take the results as weights and a mask.

With d_t = log pi_old(y_t) - log pi_eng(y_t) on trained tokens (0 when engine == trainer):

- token-level truncated IS (TIS, cap C, loss.tis_cap):
      w_t = min(exp(d_t), C)
  multiplies each token's term (grpo, gspo_token); for gspo, whose term is per sequence, the
  sequence's term is multiplied by the mean of its tokens' weights (1/L_i) sum_t w_t.
- sequence-level IS in GSPO's own form (loss.seq_is_cap): the geometric mean of the token ratios,
      rho_i = min(exp((1/L_i) sum_t d_t), C)
  multiplies sequence i's term (every loss).
- masked IS (MIS, loss.mis_cap, loss.mis_level): tokens (level "token": exp(d_t)) or whole
  sequences (level "sequence": exp((1/L_i) sum_t d_t)) whose ratio leaves [1/C, C] are left out
  of the loss (their loss mask is cleared; a sequence without trained tokens drops out of the
  mean).
All three are constants in the gradient (detached) and the identity when d = 0 (C >= 1).

Metrics (sums, reduced like the loss metrics): truncated tokens / sequences, masked tokens /
sequences, sum |d_t|, and the k3 estimate of KL(pi_eng || pi_old) per token: the tokens were sampled
from pi_eng, r_t = pi_old / pi_eng = exp(d_t), k3 = (r_t - 1) - log r_t = exp(d_t) - 1 - d_t >= 0.

Context parallelism (cp_group, as in rows.py): the per-row means (sequence IS, sequence MIS) and
the "row has trained tokens" test use sums over the group, so every rank weighs and masks a row
alike; token totals are the rank's own, row totals are reported by group rank 0 only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .rows import counts_rows, cp_sum


@dataclass
class MismatchCorrection:
    token_weights: torch.Tensor | None    # [b, s] or None
    row_weights: torch.Tensor | None      # [b] or None
    loss_mask: torch.Tensor               # [b, s] bool: the input mask minus MIS-masked tokens
    totals: dict[str, torch.Tensor]       # metric sums (see the module docstring)


def _row_mean(d: torch.Tensor, mask: torch.Tensor, cp_group) -> torch.Tensor:
    """Masked row means of constants (no gradient), the row sums over the CP group."""
    sums = cp_sum(torch.stack([torch.where(mask, d, 0).sum(-1), mask.sum(-1).to(d.dtype)]), cp_group)
    return sums[0] / sums[1].clamp(min=1)


def mismatch_correction(old_log_probs: torch.Tensor, engine_log_probs: torch.Tensor,
                        loss_mask: torch.Tensor, *, tis_cap: float | None = None,
                        seq_is_cap: float | None = None, mis_cap: float | None = None,
                        mis_level: str = "token", cp_group=None) -> MismatchCorrection:
    """The corrections of the module docstring for one batch of rows ([b, s] inputs): TIS
    weights per token (gspo_loss averages them per sequence), sequence weights, and the mask.
    cp_group: the context-parallel group the rows' positions are split over (module docstring)."""
    for name, cap in (("tis_cap", tis_cap), ("seq_is_cap", seq_is_cap), ("mis_cap", mis_cap)):
        if cap is not None and not cap >= 1.0:
            raise ValueError(f"{name}={cap}: expected >= 1")
    if mis_level not in ("token", "sequence"):
        raise ValueError(f"mis_level={mis_level!r}: expected 'token' or 'sequence'")
    mask = loss_mask.bool()
    dtype = torch.promote_types(old_log_probs.dtype, torch.float32)
    d = torch.where(mask, (old_log_probs.detach().to(dtype) - engine_log_probs.detach().to(dtype)), 0)
    d = d.clamp(-20.0, 20.0)  # ratios beyond e^20 are capped or masked anyway; no overflow
    valid = cp_sum(mask.sum(-1).to(dtype), cp_group) > 0  # the whole row has trained tokens
    share = 1.0 if counts_rows(cp_group) else 0.0  # row totals: once per CP group
    ratio = torch.exp(d)
    totals = {"mismatch_abs_sum": torch.where(mask, d.abs(), 0).sum(),
              "mismatch_k3_sum": torch.where(mask, torch.exp(d) - 1 - d, 0).sum(),
              "mismatch_sequences": valid.sum().to(dtype) * share,
              "mismatch_tokens": mask.sum().to(dtype)}
    token_w = row_w = None
    if tis_cap is not None:
        token_w = torch.where(mask, ratio.clamp(max=tis_cap), 1.0)
        totals["tis_truncated_tokens"] = (mask & (ratio > tis_cap)).sum().to(dtype)
    if seq_is_cap is not None:
        seq_ratio = torch.exp(_row_mean(d, mask, cp_group))
        rho = seq_ratio.clamp(max=seq_is_cap)
        totals["seq_is_truncated_sequences"] = (valid & (seq_ratio > seq_is_cap)).sum().to(dtype) * share
        row_w = rho
    if mis_cap is not None:
        lo, hi = 1.0 / mis_cap, mis_cap
        if mis_level == "token":
            outside = mask & ((ratio < lo) | (ratio > hi))
            totals["mis_masked_tokens"] = outside.sum().to(dtype)
            mask = mask & ~outside
        else:
            seq_ratio = torch.exp(_row_mean(d, mask, cp_group))
            outside_rows = valid & ((seq_ratio < lo) | (seq_ratio > hi))
            totals["mis_masked_sequences"] = outside_rows.sum().to(dtype) * share
            mask = mask & ~outside_rows[:, None]
    return MismatchCorrection(token_w, row_w, mask, totals)
