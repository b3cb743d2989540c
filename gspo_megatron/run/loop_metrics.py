"""A step's scalars, shaped from what the loop's parts report (the TensorBoard names are listed,
with their meaning, in metrics.py).

    t = PhaseTimer()
    with t("train"): ...                         # time/train, and when it ran
    metrics = step_scalars(rollout, updates, old, sync, t, shard, transfer, producer)
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gspo_megatron.actor.batching.batch import TrainBatch
    from rollout.generation.async_rollouts import AsyncRollouts


class PhaseTimer(dict):
    """Seconds per phase (`time/<phase>`), and when each phase ran (`spans`, monotonic)."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: dict[str, list[tuple[float, float]]] = {}

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        m0 = time.monotonic()
        yield
        self[f"time/{phase}"] = self.get(f"time/{phase}", 0.0) + time.perf_counter() - t0
        self.spans.setdefault(phase, []).append((m0, time.monotonic()))


def step_scalars(rollout: dict[str, float], updates: list[dict[str, float]], old: dict[str, float],
                 sync: dict[str, float], t: PhaseTimer, tokens: float, shard: TrainBatch,
                 transfer: dict[str, float], producer: AsyncRollouts | None = None) -> dict[str, float]:
    """Every scalar of one step: the rollout's (rank 0's batch metrics), the updates' and the old
    log-prob pass's (train_metrics), the weight sync's, the phases' seconds, throughput, the batch
    transfer's, and (asynchronous, rank 0: the rollout thread) the overlap."""
    metrics = dict(rollout)
    metrics.update(train_metrics(updates, old), **sync_metrics(sync), **t)
    if producer is not None:
        metrics.update(overlap_metrics(t, producer))
    metrics["perf/tokens_per_s"] = tokens / t["time/step"]
    metrics.update({"batch/bytes_per_rank": transfer["bytes_per_rank"],
                    "time/batch_transfer": transfer["batch_transfer_s"]})
    if shard.dp_token_imbalance is not None:  # (set by the transfer: always, in the loop)
        metrics["batch/dp_token_imbalance"] = shard.dp_token_imbalance
    return metrics


def train_metrics(updates: list[dict[str, float]], old: dict[str, float]) -> dict[str, float]:
    """Mini-batch metrics of the actor -> per-step TensorBoard scalars."""
    def mean(k: str) -> float | None:
        vals = [u[k] for u in updates if k in u]
        return sum(vals) / len(vals) if vals else None
    out = {
        "train/loss": mean("loss"), "train/clip_fraction": mean("clip_fraction"),
        "train/seq_ratio_mean": mean("seq_ratio_mean"),
        "train/seq_ratio_min": min((u["seq_ratio_min"] for u in updates if "seq_ratio_min" in u),
                                   default=None),
        "train/seq_ratio_max": max((u["seq_ratio_max"] for u in updates if "seq_ratio_max" in u),
                                   default=None),
        "train/grad_norm": mean("grad_norm"), "train/lr": updates[-1].get("lr"),
        "train/entropy": old.get("entropy_mean", mean("entropy_mean")),
        "train/kl": mean("kl"),
        # The first (on-policy) pass compares trainer and SGLang on the same weights.
        "train/logprob_abs_diff": old.get("logprob_abs_diff_vs_rollout",
                                          mean("logprob_abs_diff_vs_rollout")),
        "train/logprob_k3": old.get("logprob_k3_vs_rollout", mean("logprob_k3_vs_rollout")),
    }
    # Train/inference mismatch corrections (loss.tis_cap / seq_is_cap / mis_cap), per update.
    for key in ("mismatch_abs_mean", "mismatch_k3", "tis_truncated_fraction",
                "seq_is_truncated_fraction", "mis_masked_fraction"):
        out[f"mismatch/{key.removeprefix('mismatch_')}"] = mean(key)
    # MoE routing (moe: section): drift since pi_old, SGLang vs megatron, the replay self-check.
    for key, value in old.items():
        if key.startswith("routing_") and not key.endswith("_sets"):
            name = key.removeprefix("routing_")
            out[f"routing/{name}" if "_layer/" not in name else
                f"routing_layers/{name.replace('_layer/', '_layer_')}"] = value
    return {k: v for k, v in out.items() if v is not None}


def overlap_metrics(t: PhaseTimer, producer: AsyncRollouts) -> dict[str, float]:
    """Busy fractions of the rollout thread and the trainer over the step, and their overlap."""
    start, end = t.spans["step"][0]
    train = [s for phase, spans in t.spans.items() if phase not in ("step", "rollout") for s in spans]
    rollout = producer.busy_spans(start, end)
    wall = max(end - start, 1e-9)
    both = sum(max(0.0, min(b, d) - max(a, c)) for a, b in train for c, d in rollout)
    return {"async/rollout_busy": sum(b - a for a, b in rollout) / wall,
            "async/train_busy": sum(b - a for a, b in train) / wall, "async/overlap": both / wall}


def sync_metrics(report: dict[str, float]) -> dict[str, float]:
    """The weight sync's report (rank 0's view) -> TensorBoard scalars (none for a deferred one)."""
    if report.get("deferred"):
        return {}
    return {"perf/sync_gb_per_s": report["gb_per_s"], "sync/gb": report["bytes"] / 1e9,
            "sync/bytes": report["bytes"], "sync/rank0_bytes": report["rank0_bytes"],
            "sync/senders": report["senders"], "sync/changed_fraction": report["changed_fraction"],
            "sync/full_syncs": report["full_syncs"],
            "sync/checksum_mismatches": report["checksum_mismatches"],
            "sync/buckets": report["buckets"], "sync/attempts": report["attempts"]}
