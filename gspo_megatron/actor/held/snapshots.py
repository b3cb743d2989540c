"""Host copies of one rank's parameter shards, swapped in for a forward pass: the KL reference
policy, and the weights of recent versions for pi_old of asynchronous rollouts.

    snap = host_copy(params)                  # this rank's shards, on the CPU
    with swapped_in(params, snap):            # the model runs with them; restored bit for bit
        ...
    versions = VersionedWeights(keep=2)       # train.max_staleness versions back
    versions.keep(7, params)                  # before version 7's updates
    with versions.of(6, params): ...          # pi_old of tokens version 6 generated

Only parameter data is swapped: DDP's buffers and the optimizer's fp32 main params are untouched,
and swapping twice restores every bit. One extra host copy of the rank's shards per snapshot,
never a second model or optimizer.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch


def host_copy(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().to("cpu", copy=True) for p in params]


@torch.no_grad()
def swap(params: Sequence[torch.Tensor], stored: Sequence[torch.Tensor]) -> None:
    """Exchange the parameters' data with `stored`, in place."""
    for p, r in zip(params, stored):
        held = p.detach().to("cpu", copy=True)
        p.copy_(r.to(p.device))
        r.copy_(held)


@contextlib.contextmanager
def swapped_in(params: Sequence[torch.Tensor], stored: Sequence[torch.Tensor]) -> Iterator[None]:
    swap(params, stored)
    try:
        yield
    finally:
        swap(params, stored)


class VersionedWeights:
    """The weights of the last `keep` versions, as host copies (train.max_staleness of them)."""

    def __init__(self, keep: int) -> None:
        self.keep_count = keep
        self.store: dict[int, list[torch.Tensor]] = {}

    def keep(self, version: int, params: Sequence[torch.Tensor]) -> None:
        """Copy the live weights as `version`; forget all but the newest `keep` versions."""
        if self.keep_count < 1:
            return
        self.store[version] = host_copy(params)
        for v in sorted(self.store)[:-self.keep_count]:
            del self.store[v]

    def versions(self) -> list[int]:
        return sorted(self.store)

    @contextlib.contextmanager
    def of(self, version: int, params: Sequence[torch.Tensor]) -> Iterator[None]:
        if version not in self.store:
            raise KeyError(f"no weights of version {version} kept (kept: {self.versions()})")
        with swapped_in(params, self.store[version]):
            yield


def old_log_probs_per_version(forward_only, batch, versions: list[int], live: int, weights_of,
                              ) -> tuple[torch.Tensor | None, dict[str, float]]:
    """pi_old per token from the weights of the version that generated it: one forward-only pass
    (`forward_only(part)`) per version in `versions` (the same list on every rank: every pass is
    collective), with the kept weights of that version swapped in (`weights_of(v)`, a context; the
    live version runs as it is) and, with routing replay, the routes that version's forward passes
    recorded; each pass's metrics over its own tokens, combined weighted by their counts (the
    routing comparisons by their compared sets; per layer, the last pass's)."""
    import dataclasses

    from gspo_megatron.actor.held.versioned_routes import routes_of_version
    out, parts = None, []
    for v in versions:
        mine = batch.loss_mask & (batch.weight_versions == v)
        # routing replay: only the routes v's own passes computed (versioned_routes.py)
        part = dataclasses.replace(batch, loss_mask=mine, routed_experts=routes_of_version(batch, v))
        with contextlib.nullcontext() if v == live else weights_of(v):
            lp, m = forward_only(part)
        parts.append(m)
        if lp is not None:
            out = lp if out is None else torch.where(mine, lp, out)
    n = [p.get("tokens", 0.0) for p in parts]
    total = max(sum(n), 1.0)
    metrics = dict(parts[-1])
    for key in ("log_prob_mean", "entropy_mean", "logprob_abs_diff_vs_rollout", "logprob_k3_vs_rollout"):
        if all(key in p for p in parts):
            metrics[key] = sum(p[key] * k for p, k in zip(parts, n)) / total
    metrics["tokens"] = sum(n)
    metrics["versions"] = float(len(versions))
    for key in [k for k in metrics if k.startswith("routing_") and k.endswith("_mismatch")]:
        sets = [p.get(key + "_sets", 0.0) for p in parts]  # each pass's compared sets: over all
        if all(key in p for p in parts) and sum(sets):
            metrics[key] = sum(p[key] * k for p, k in zip(parts, sets)) / sum(sets)
            metrics[key + "_sets"] = sum(sets)
    return out, metrics
