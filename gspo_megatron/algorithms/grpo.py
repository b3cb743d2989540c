"""GRPO baseline (Eqs. 2-3): token-level importance ratios, kept for comparison runs. It takes every
aggregation (loss.loss_agg_mode, a row of terms.AGGREGATIONS: verl's and ROLL's agg_loss modes)."""
from __future__ import annotations

import torch

from .gspo import clipped_objective_loss
from .kl import rows_kl
from .registry import GRPO_CLIP
from .rows import LOG_RATIO_CLAMP, check_aggregation, finish_loss, prepare_rows
from .terms import SEQUENCE_MEAN, Aggregation


def grpo_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
              loss_mask: torch.Tensor, *, eps_low: float = GRPO_CLIP[0], eps_high: float = GRPO_CLIP[1],
              reduction: str = "mean", ref_log_probs: torch.Tensor | None = None,
              kl_coef: float = 0.0, kl_estimator: str = "k3", token_weights: torch.Tensor | None = None,
              row_weights: torch.Tensor | None = None, dual_clip_c: float | None = None,
              loss_agg_mode: Aggregation | str = SEQUENCE_MEAN,
              cp_group=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss: token terms `l_t = -min(w_t A, clip(w_t) A)`, `w_t = exp(l_{i,t})`, aggregated by
    loss_agg_mode (an AGGREGATIONS row's name, or an Aggregation with its settings; default: per
    row `(1/L_i) sum_t l_t`, averaged over rows as in `gspo_loss`).

    advantages: `[b]` (one per sequence, as GRPO defines them) or `[b, s]`. With reduction "mean"
    the rows' terms are averaged over rows (over trained tokens for token-mean); "sum" sums them.
    dual_clip_c: as in `gspo_loss`, per token. `clip_fraction` is the fraction of trainable tokens
    clipped; `seq_ratio_*` report the GSPO sequence ratio `exp(mean l)` of the same batch, for
    comparison. cp_group: as in `gspo_loss` (the token terms' row sums are reduced over it).
    """
    aggregation = check_aggregation("grpo", loss_agg_mode, dual_clip_c)
    rows, adv = prepare_rows(log_probs, old_log_probs, loss_mask, advantages, ("row", "token"),
                             reduction, eps_low, eps_high, ref_log_probs, kl_coef, cp_group)
    if adv.dim() == 1:
        adv = adv[:, None]  # [b, 1]
    log_ratio = (rows.log_probs - rows.old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [b, s]
    per_token, clipped = clipped_objective_loss(torch.exp(log_ratio), adv, eps_low, eps_high,
                                                dual_clip_c)  # [b, s]
    if token_weights is not None:  # truncated importance weights of the mismatch (mismatch.py)
        per_token = per_token * token_weights.detach().to(per_token.dtype)
    with torch.no_grad():
        seq_ratio = torch.exp(rows.seq_log_ratio())
    return finish_loss(rows, per_token=per_token, row_weights=row_weights, reduction=reduction,
                       seq_ratio=seq_ratio, clipped_tokens=clipped, clipped_sequences=None,
                       kl=rows_kl(rows, ref_log_probs, kl_estimator), kl_coef=kl_coef,
                       loss_agg_mode=aggregation)
