"""What the losses share: input checks, masking, per-sequence (row) means, the aggregation
(loss.loss_agg_mode: a row of terms.AGGREGATIONS, whose functions are here) and the reduction.

Masked positions are replaced with `torch.where`, never multiplied by the mask: a NaN or inf in a
padded position (a log-prob of a pad token, garbage after a packed segment) then changes neither
the value nor the gradient, and the position gets exactly zero gradient (docs/algorithm.md, property 6).

Context parallelism (`cp_group`): each rank of the group holds some positions of every row (the
actor's zig-zag chunks, parallel/context.py). Every per-row sum -- token counts L_i, the masked
sums behind s_i, the per-token terms of gspo_token / grpo, the KL sums, the mismatch corrections'
means -- is summed over the group by `cp_sum` BEFORE the exp or the division, so every rank holds
the same full-row s_i, L_i and row terms, and the returned loss is the full-sequence loss on each
rank. `cp_sum`'s backward passes the gradient through unchanged: each rank's backward gives its own
positions d loss / d logp_{i,t} of the full-sequence loss, so the gradients of the ranks together
are exactly the one-process gradient (not cp times it). How the actor's loss scale and megatron's
CP factor then give the full-sequence parameter gradient: actor/steps.py. Metrics: token totals are
the rank's own positions (they add up over the group); row totals (num_sequences, seq_ratio_sum,
clipped_sequences, kl_sum) are reported by the group's rank 0 only, so that summing the metrics
over the group counts each row once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .loss_metrics import finalize_metrics
from .registry import LOSSES
from .terms import SEQUENCE_MEAN, Aggregation

# Log-ratios are clamped to [-20, 20] before exp: e^20 ~ 4.9e8 is finite in fp32/bf16, and no
# ratio that is not clipped anyway lies near it (clip ranges are 3e-4 .. 0.27), so the clamp cannot
# change a value or gradient in the normal range. Beyond it the gradient is zero, which treats a
# pathological sequence (its mean log-ratio over 20 nats away from pi_old) as clipped instead of
# stepping by e^20 x A.
LOG_RATIO_CLAMP = 20.0

REDUCTIONS = ("mean", "sum")


class _ContextSum(torch.autograd.Function):
    """Sum over the context-parallel group; backward: the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.detach().clone().contiguous()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def cp_sum(x: torch.Tensor, group) -> torch.Tensor:
    """`x` summed over the ranks of `group` (None: `x` itself). Differentiable: the gradient w.r.t.
    this rank's `x` is the gradient w.r.t. the sum (see the module docstring for why)."""
    if group is None:
        return x
    return _ContextSum.apply(x, group)


def counts_rows(group) -> bool:
    """True on the rank that reports row totals: every rank without a group, else group rank 0."""
    return group is None or dist.get_rank(group) == 0


@dataclass
class Rows:
    """A batch of `b` rows of `s` positions, masked and cast to the compute dtype."""
    log_probs: torch.Tensor      # [b, s], 0 at masked positions
    old_log_probs: torch.Tensor  # [b, s], 0 at masked positions (no grad)
    mask: torch.Tensor           # [b, s] bool
    lengths: torch.Tensor        # [b], L_i of the whole row (over the CP group; compute dtype)
    valid: torch.Tensor          # [b] bool, L_i > 0
    cp_group: object = None      # context-parallel group holding the rest of each row, or None

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Masked per-row sum sum_t m_t x_t over the whole row -> [b] (over the CP group)."""
        return cp_sum(torch.where(self.mask, x, 0).sum(dim=-1), self.cp_group)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """Masked per-row mean (1/L_i) sum_t m_t x_t over the whole row -> [b]; 0 for rows with
        L_i = 0. The sum runs over the CP group (module docstring)."""
        return self.sum(x) / self.lengths.clamp(min=1)

    def aggregate(self, per_token: torch.Tensor, aggregation: Aggregation) -> torch.Tensor:
        """Each row's share of the loss under `aggregation` (its AGGREGATIONS row's function) -> [b]."""
        return aggregation.spec.row_terms()(self, per_token, aggregation.settings)

    def weighted(self, per_row: torch.Tensor, *weights: torch.Tensor | None) -> torch.Tensor:
        """per_row times each given `[b]` weight (constants; None = 1)."""
        for w in weights:
            if w is not None:
                per_row = per_row * w.detach().to(per_row.dtype)
        return per_row

    def seq_log_ratio(self) -> torch.Tensor:
        """(1/L_i) sum_t m_t l_{i,t}, clamped -> [b] (GSPO Eq. 7 before the exp)."""
        return self.mean(self.log_probs - self.old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


# The functions of the AGGREGATIONS rows (terms.py): fn(rows, per_token [b, s], settings) -> [b].
def token_mean(rows: Rows, per_token: torch.Tensor, settings: object = None) -> torch.Tensor:
    return rows.mean(per_token)


def token_sum(rows: Rows, per_token: torch.Tensor, settings: object = None) -> torch.Tensor:
    return rows.sum(per_token)


def token_sum_over_constant(rows: Rows, per_token: torch.Tensor, settings) -> torch.Tensor:
    return rows.sum(per_token) / settings.token_sum_norm


def check_aggregation(name: str, mode: Aggregation | str, dual_clip_c: float | None) -> Aggregation:
    """A loss's aggregation against its LOSSES row (registry.LossSettings says the same to the
    config), errors naming the values; the aggregation with its settings."""
    aggregation = Aggregation.of(mode)
    if not LOSSES[name].takes_aggregation(aggregation.name):
        raise ValueError(f"loss_agg_mode={aggregation.name!r}: the {name} loss takes "
                         f"{' or '.join(LOSSES[name].aggregation_names())}")
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c={dual_clip_c!r}: expected > 1")
    return aggregation


def prepare_rows(log_probs: torch.Tensor, old_log_probs: torch.Tensor, loss_mask: torch.Tensor,
                 advantages: torch.Tensor, advantage_shapes: tuple[str, ...],
                 reduction: str, eps_low: float, eps_high: float,
                 ref_log_probs: torch.Tensor | None, kl_coef: float,
                 cp_group=None) -> tuple[Rows, torch.Tensor]:
    """Check shapes and options (errors name the offending values), return (rows, advantages).
    cp_group: the context-parallel group the rows' positions are split over (module docstring)."""
    if log_probs.dim() != 2:
        raise ValueError(f"log_probs must be [b, s], got shape {tuple(log_probs.shape)}")
    shape = log_probs.shape
    for name, t in (("old_log_probs", old_log_probs), ("loss_mask", loss_mask),
                    ("ref_log_probs", ref_log_probs)):
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like log_probs")
    allowed = {"row": (shape[0],), "token": tuple(shape)}
    if tuple(advantages.shape) not in [allowed[k] for k in advantage_shapes]:
        raise ValueError(f"advantages have shape {tuple(advantages.shape)}, expected "
                         + " or ".join(str(allowed[k]) for k in advantage_shapes))
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not (0.0 <= eps_low < 1.0 and eps_high >= 0.0):
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    if kl_coef != 0.0 and ref_log_probs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_log_probs")

    # fp32 at least (bf16 log-probs would round s_i to ~3 digits, coarser than eps = 3e-4);
    # fp64 inputs stay fp64 (finite-difference tests).
    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    mask = loss_mask != 0  # bool or 0/1 masks alike
    lengths = cp_sum(mask.sum(dim=-1).to(dtype), cp_group)
    rows = Rows(log_probs=torch.where(mask, log_probs.to(dtype), 0),
                old_log_probs=torch.where(mask, old_log_probs.detach().to(dtype), 0),
                mask=mask, lengths=lengths, valid=lengths > 0, cp_group=cp_group)
    return rows, advantages.detach().to(dtype)


def finish_loss(rows: Rows, *, per_row: torch.Tensor | None = None, per_token: torch.Tensor | None = None,
                row_weights: torch.Tensor | None = None, reduction: str, seq_ratio: torch.Tensor,
                clipped_tokens: torch.Tensor, clipped_sequences: torch.Tensor | None,
                kl: torch.Tensor | None, kl_coef: float,
                loss_agg_mode: Aggregation | str = SEQUENCE_MEAN) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Aggregate the terms of -J (and the KL term), reduce over valid rows, build the metrics.

    per_token: `[b, s]` terms l_it (grpo, gspo_token), aggregated per row by `loss_agg_mode`
    (Rows.aggregate); or per_row: `[b]` row terms already aggregated by it (gspo). row_weights:
    `[b]` constants on each row's policy term (the mismatch corrections; not on the KL term).
    kl: `[b, s]` per-token KL estimate (kl.rows_kl) or None, aggregated like the policy terms.
    The reduction divides by the rows with a trained token, or, with token-mean, by the trained
    tokens (reduction "mean"), or not at all ("sum": the actor divides by the global count).
    seq_ratio: `[b]` s_i; clipped_tokens: `[b, s]` bool; clipped_sequences: `[b]` bool (GSPO) or
    None. Under context parallelism the loss is the full rows' on every rank; the metrics are this
    rank's share (module docstring).
    """
    aggregation = Aggregation.of(loss_agg_mode)
    if per_row is not None and per_token is None:
        terms = per_row  # already aggregated by the loss, with this mode (gspo's sequence terms)
    elif per_token is not None and per_row is None:
        terms = rows.aggregate(per_token, aggregation)
    else:
        raise ValueError("finish_loss takes per_row or per_token terms, exactly one")
    terms = rows.weighted(terms, row_weights)
    kl_mean = None
    if kl is not None:
        kl_mean = rows.mean(kl)
        if kl_coef != 0.0:
            terms = terms + kl_coef * rows.aggregate(kl, aggregation)
    valid = rows.valid
    total = torch.where(valid, terms, 0).sum()
    num_sequences = valid.sum().to(terms.dtype)
    by_tokens = aggregation.spec.divides_by == "tokens"
    units = torch.where(valid, rows.lengths, 0).sum() if by_tokens else num_sequences
    loss = total if reduction == "sum" else total / units.clamp(min=1)

    with torch.no_grad():
        ratio = seq_ratio.detach()
        share = 1.0 if counts_rows(rows.cp_group) else 0.0  # row totals: once per CP group
        inf = torch.tensor(float("inf"), dtype=ratio.dtype, device=ratio.device)
        totals = {
            "num_sequences": num_sequences.detach() * share,
            "num_tokens": rows.mask.sum().to(ratio.dtype),  # this rank's positions
            "clipped_tokens": (clipped_tokens & rows.mask).sum().to(ratio.dtype),
            "seq_ratio_sum": torch.where(valid, ratio, 0).sum() * share,
            "seq_ratio_min": torch.where(valid, ratio, inf).min() if ratio.numel() else inf,
            "seq_ratio_max": torch.where(valid, ratio, -inf).max() if ratio.numel() else -inf,
        }
        if clipped_sequences is not None:
            totals["clipped_sequences"] = (clipped_sequences & valid).sum().to(ratio.dtype) * share
        if kl_mean is not None:
            totals["kl_sum"] = torch.where(valid, kl_mean.detach(), 0).sum() * share
    return loss, finalize_metrics(totals)
