"""Loss metrics that aggregate exactly over micro-batches, DP ranks and uneven splits.

Every loss returns the same kinds of keys:
- additive totals (`METRIC_REDUCTIONS[key] == "sum"`): `num_sequences` (rows with >= 1 trainable
  token), `num_tokens` (trainable tokens), `clipped_tokens`, `seq_ratio_sum`, `kl_sum` (with a
  reference policy) and, for GSPO only, `clipped_sequences`;
- extremes: `seq_ratio_min` ("min"), `seq_ratio_max` ("max"); over zero valid rows they are the
  identities +inf / -inf so that combining with other micro-batches stays exact;
- derived ratios, recomputed from the totals by `finalize_metrics` (never summed): `clip_fraction`,
  `token_clip_fraction`, `seq_ratio_mean`, `kl`.

`clip_fraction` is the fraction of the units the algorithm clips: sequences for GSPO (there is one
clip decision per sequence), tokens for GSPO-token and GRPO. `token_clip_fraction` (clipped
trainable tokens / trainable tokens; a clipped GSPO sequence counts all its tokens) is the paper's
measure and comparable across the three.

To aggregate across processes: all-reduce each key of `METRIC_REDUCTIONS` with its op
(SUM / MIN / MAX), then call `finalize_metrics`. Within one process `combine_metrics` does both.
"""
from __future__ import annotations

from typing import Iterable

import torch

from .registry import METRIC_REDUCTIONS



def finalize_metrics(totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add the derived ratios to a dict of totals (a copy; inputs are not modified)."""
    out = dict(totals)
    n_seq = totals["num_sequences"].clamp(min=1)
    n_tok = totals["num_tokens"].clamp(min=1)
    out["token_clip_fraction"] = totals["clipped_tokens"] / n_tok
    if "clipped_sequences" in totals:
        out["clip_fraction"] = totals["clipped_sequences"] / n_seq
    else:
        out["clip_fraction"] = out["token_clip_fraction"]
    out["seq_ratio_mean"] = totals["seq_ratio_sum"] / n_seq
    if "kl_sum" in totals:
        out["kl"] = totals["kl_sum"] / n_seq
    return out


def combine_metrics(metrics: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Metrics of several loss calls (micro-batches) -> the metrics of their union."""
    metrics = list(metrics)
    if not metrics:
        raise ValueError("combine_metrics needs at least one metrics dict, got none")
    ops = {"sum": lambda xs: torch.stack(xs).sum(), "min": lambda xs: torch.stack(xs).min(),
           "max": lambda xs: torch.stack(xs).max()}
    totals = {}
    for key, op in METRIC_REDUCTIONS.items():
        present = [m[key] for m in metrics if key in m]
        if present:
            if len(present) != len(metrics):
                raise ValueError(f"metric {key!r} is in {len(present)} of {len(metrics)} dicts")
            totals[key] = ops[op](present)
    return finalize_metrics(totals)
