"""GSPO (Eqs. 5-7) and GSPO-token (Eqs. 13-14): one importance ratio per sequence.

Reductions and the pipeline-schedule contract
---------------------------------------------
`reduction="mean"` returns `-J` averaged over the rows of this call that have >= 1 trainable token.
`reduction="sum"` returns the SUM of the per-row `-J_i` over those rows. The actor uses "sum" and
divides by the number of valid sequences of the whole global batch itself; megatron-core's schedule
divides each micro-batch loss by the number of micro-batches and the DP gradient all-reduce averages
over ranks, so the actor multiplies by `num_microbatches * dp_size` as well. Then the gradient equals
the full-batch gradient for any split, uneven ones included (docs/algorithm.md "Aggregation", property 11).

Aggregation (loss.loss_agg_mode). The paper's is the default: a mean over sequences of one term
each (Eq. 5, seq-mean-token-mean). Both losses take every row of AGGREGATIONS, as ROLL computes
`importance_sampling: seq` (roll/pipeline/rlvr/actor_worker.py ActorWorker.loss_func, then agg_loss;
slime's gspo the same): the sequence ratio s_i is broadcast to the row's trained tokens, each token's
term is `-min(s_i A_{i,t}, clip(s_i) A_{i,t})`, and the mode aggregates those terms, so that with
seq-mean-token-sum a sequence weighs by its length L_i, with token-mean by L_i over the batch's
tokens. gspo differentiates through s_i (ROLL's and slime's gradient: every token of a row gets
s_i / L_i times the row's summed active advantages); gspo_token through its token factor
(Eqs. 13-14: token t gets s_i A_{i,t}); the two agree when A is constant along a row.
gspo's row term is formed as `value + (s_i - sg[s_i]) * slope`, value and slope the mode's
aggregation of the tokens' constant terms and of d term / d s_i (0 where clipped): the same value
and gradient as aggregating the tokens' terms directly, and under context parallelism each rank's
share of the full row's gradient (both are summed over the group before they meet s_i).

Loss terms use an explicit clip decision instead of `min(.)`: for A > 0 the row is clipped when
s > 1 + eps_high, for A < 0 when s < 1 - eps_low; a clipped row contributes the constant
`-clip(s) A` (zero gradient, as in the min form), the others `-s A`. This is the min form exactly,
and gives the clip count the metrics report. The dual clip (dual_clip_c = c > 1, for A < 0) caps
`-s A` at `-c A` where s > c: the constant branch again (verl compute_policy_loss_vanilla's
clip_ratio_c; clipped units count in the clip metrics).
"""
from __future__ import annotations

import torch

from .kl import rows_kl
from .registry import GSPO_CLIP
from .rows import check_aggregation, finish_loss, prepare_rows
from .terms import SEQUENCE_MEAN, Aggregation


def clip_decision(ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float,
                  eps_high: float) -> torch.Tensor:
    """Where `min(ratio A, clip(ratio) A)` takes the clipped (constant) branch. Broadcasts."""
    return ((advantages > 0) & (ratio > 1.0 + eps_high)) | ((advantages < 0) & (ratio < 1.0 - eps_low))


def clipped_objective_loss(ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float,
                           eps_high: float, dual_clip_c: float | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """`-min(ratio A, clip(ratio, 1-eps_low, 1+eps_high) A)` elementwise, and the clip decision;
    with dual_clip_c = c, `min(that, -c A)` where A < 0 (the constant -c A where ratio > c)."""
    clipped = clip_decision(ratio, advantages, eps_low, eps_high)
    bound = ratio.detach().clamp(1.0 - eps_low, 1.0 + eps_high)
    if dual_clip_c is not None:
        dual = (advantages < 0) & (ratio > dual_clip_c)
        bound = torch.where(dual, torch.full_like(bound, dual_clip_c), bound)
        clipped = clipped | dual
    return torch.where(clipped, -bound * advantages, -ratio * advantages), clipped


def gspo_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
              loss_mask: torch.Tensor, *, eps_low: float = GSPO_CLIP[0], eps_high: float = GSPO_CLIP[1],
              reduction: str = "mean", ref_log_probs: torch.Tensor | None = None,
              kl_coef: float = 0.0, kl_estimator: str = "k3", token_weights: torch.Tensor | None = None,
              row_weights: torch.Tensor | None = None, dual_clip_c: float | None = None,
              loss_agg_mode: Aggregation | str = SEQUENCE_MEAN, cp_group=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO loss `-J` (Eq. 5) with the sequence ratio `s_i` of Eq. 7.

    log_probs, old_log_probs, loss_mask: `[b, s]` (old/ref are treated as constants); advantages:
    `[b]`, or `[b, s]` (ROLL's per-token advantages with importance_sampling: seq: the module
    docstring). `s_i = exp(masked mean of (log_probs - old_log_probs))`, the log-ratio clamped to +-20
    before exp (see rows.LOG_RATIO_CLAMP). With `ref_log_probs`, `kl_coef * KL_i` (per-row masked
    mean of the kl_estimator's estimate) is added to each row's term. Returns `(loss, metrics)`;
    metrics are detached, see loss_metrics.py (`clip_fraction` = clipped sequences / valid
    sequences, a row counting when all its trained tokens are). token_weights `[b, s]` / row_weights
    `[b]`: constant importance weights of the train/inference mismatch (mismatch.py): each token's
    term is multiplied by its weight (with seq-mean-token-mean: the row's term by the mean of its
    tokens' weights), a row's by its row weight. loss_agg_mode, dual_clip_c: the module docstring.
    cp_group: the context-parallel
    group the rows' positions are split over; the per-row sums are reduced over it before the exp
    (rows.py).
    """
    aggregation = check_aggregation("gspo", loss_agg_mode, dual_clip_c)
    rows, adv = prepare_rows(log_probs, old_log_probs, loss_mask, advantages, ("row", "token"), reduction,
                             eps_low, eps_high, ref_log_probs, kl_coef, cp_group)
    seq_ratio = torch.exp(rows.seq_log_ratio())  # [b]
    a = adv[:, None] if adv.dim() == 1 else adv  # [b, 1] or [b, s]
    value, clipped = clipped_objective_loss(seq_ratio.detach()[:, None], a, eps_low, eps_high, dual_clip_c)
    slope = torch.where(clipped, torch.zeros_like(a), -a)  # d term / d s_i per token (0 where clipped)
    value, slope, clipped = (x.expand_as(rows.mask) for x in (value, slope, clipped))  # [b, s]
    if token_weights is not None:
        w = token_weights.detach().to(value.dtype)
        value, slope = value * w, slope * w
    per_row = rows.aggregate(value, aggregation) + (seq_ratio - seq_ratio.detach()) * rows.aggregate(slope, aggregation)
    whole_row = rows.sum(clipped.to(seq_ratio.dtype)) >= rows.lengths  # every trained token clipped
    return finish_loss(rows, per_row=per_row, row_weights=row_weights, reduction=reduction,
                       seq_ratio=seq_ratio, clipped_tokens=clipped, clipped_sequences=whole_row,
                       kl=rows_kl(rows, ref_log_probs, kl_estimator), kl_coef=kl_coef,
                       loss_agg_mode=aggregation)


def gspo_token_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                    loss_mask: torch.Tensor, *, eps_low: float = GSPO_CLIP[0], eps_high: float = GSPO_CLIP[1],
                    reduction: str = "mean", ref_log_probs: torch.Tensor | None = None,
                    kl_coef: float = 0.0, kl_estimator: str = "k3", token_weights: torch.Tensor | None = None,
                    row_weights: torch.Tensor | None = None, dual_clip_c: float | None = None,
                    loss_agg_mode: Aggregation | str = SEQUENCE_MEAN,
                    cp_group=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token (Eqs. 13-14): per-token advantages `[b, s]`, otherwise as `gspo_loss`
    (token_weights multiply the token terms, row_weights the rows'; dual_clip_c, cp_group as there).

    `s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]`: its value is s_i, its gradient w.r.t. log pi(y_t) is
    s_i, so the row term `(1/L_i) sum_t -min(s_{i,t} A_{i,t}, clip(s_{i,t}) A_{i,t})` equals GSPO
    when A_{i,t} = A_i. Clipping is decided per token (the sign of A_{i,t} may vary along a row), so
    `clip_fraction` here is the fraction of trainable tokens clipped.
    """
    aggregation = check_aggregation("gspo_token", loss_agg_mode, dual_clip_c)
    rows, adv = prepare_rows(log_probs, old_log_probs, loss_mask, advantages, ("token",), reduction,
                             eps_low, eps_high, ref_log_probs, kl_coef, cp_group)
    seq_ratio = torch.exp(rows.seq_log_ratio())  # [b]
    token_ratio = seq_ratio.detach()[:, None] * torch.exp(rows.log_probs - rows.log_probs.detach())  # [b, s]
    per_token, clipped = clipped_objective_loss(token_ratio, adv, eps_low, eps_high, dual_clip_c)  # [b, s]
    if token_weights is not None:
        per_token = per_token * token_weights.detach().to(per_token.dtype)
    return finish_loss(rows, per_token=per_token, row_weights=row_weights, reduction=reduction,
                       seq_ratio=seq_ratio, clipped_tokens=clipped, clipped_sequences=None,
                       kl=rows_kl(rows, ref_log_probs, kl_estimator), kl_coef=kl_coef,
                       loss_agg_mode=aggregation)
