"""The policies an Actor holds besides the live one, host copies of its rank's shards swapped in
for a forward pass (snapshots.py): the KL reference, and the weights of recent versions for pi_old
of asynchronous rollouts and the routes each version computed (versioned_routes.py). A part of the
Actor (actor.py): a mixin over its chunks, its forward-only pass and its parameters.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gspo_megatron.actor.batching.batch import TrainBatch
from gspo_megatron.actor.held.snapshots import VersionedWeights, host_copy, old_log_probs_per_version, swapped_in
from gspo_megatron.actor.held.versioned_routes import version_mismatch
from gspo_megatron.actor.weights.full import load_full_state_dict
from gspo_megatron.lora.attach import adapters_off

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel

    from gspo_megatron.lora.lora_settings import LoraSettings


class HeldPolicies:
    """The Actor's held policies (module docstring); the Actor sets the attributes below."""

    _reference: list[torch.Tensor] | None
    _versions: VersionedWeights
    if TYPE_CHECKING:  # the Actor's (actor.py)
        lora: LoraSettings

    @property
    def chunks(self) -> list[DistributedDataParallel]:
        raise NotImplementedError

    @property
    def models(self) -> list[torch.nn.Module]:
        raise NotImplementedError

    def _local_params(self) -> list[torch.nn.Parameter]:
        raise NotImplementedError

    def _forward_only(self, batch: TrainBatch, **routing: bool) -> tuple[torch.Tensor | None, dict[str, float]]:
        raise NotImplementedError

    def _trained_params(self) -> list[torch.nn.Parameter]:
        """The parameters an optimizer step changes (with LoRA: the adapters alone), what a version
        differs by."""
        return [p for p in self._local_params() if p.requires_grad]

    # --- KL reference policy ---------------------------------------------------------------------
    @torch.no_grad()
    def set_reference(self, full: dict[str, torch.Tensor] | None = None) -> None:
        """Keep this rank's parameter shards as the KL reference policy: the current weights, or
        those of `full` (one-process megatron tensors, e.g. a saved reference; every rank passes
        it, and the current weights are left as they were). The copy lives in host memory
        (snapshots.py). With LoRA the reference is the base, the same model with its adapters
        off: nothing is copied, and `full` is refused."""
        if self.lora.enabled:
            if full is not None:
                raise ValueError("set_reference(full) with LoRA: the reference policy is the base "
                                 "(the adapters off), not a weight set of its own")
            self._reference = []
            return
        params = self._local_params()
        if full is None:
            self._reference = host_copy(params)
            return
        current = [p.detach().clone() for p in params]
        load_full_state_dict(self.chunks, full)
        self._reference = host_copy(params)
        for p, c in zip(params, current):
            p.copy_(c)

    def compute_ref_log_probs(self, batch: TrainBatch) -> tuple[torch.Tensor | None, dict[str, float]]:
        """Log-probs under the reference policy (set_reference), for the KL penalty: `(ref_log_probs
        [b, s] on the last stage else None, metrics)`; the caller sets `batch.ref_log_probs`.
        A forward-only pass with the reference weights swapped in, then swapped back."""
        if self._reference is None:
            raise RuntimeError("compute_ref_log_probs needs a reference policy: call set_reference() first")
        if self.lora.enabled:
            with adapters_off(self.models):
                return self._forward_only(batch)
        with swapped_in(self._local_params(), self._reference):
            return self._forward_only(batch)

    # --- pi_old of asynchronous rollouts (train.max_staleness > 0; docs/async.md) ----------------
    def keep_version(self, version: int) -> None:
        """Before the updates of `version`: keep its weights on the host, so that tokens it
        generates can get their pi_old recomputed later (the newest max_staleness versions)."""
        self._versions.keep(version, self._trained_params())

    def kept_versions(self) -> list[int]:
        """The versions whose weights keep_version holds."""
        return self._versions.versions()

    def _versioned_old_log_probs(self, batch: TrainBatch, versions: list[int], live: int,
                                 ) -> tuple[torch.Tensor | None, dict[str, float]]:
        """pi_old per token from the weights of the version that generated it (snapshots.py)."""
        return old_log_probs_per_version(
            lambda part: self._forward_only(part, compare_engine=batch.routed_experts is not None),
            batch, versions, live, lambda v: self._versions.of(v, self._trained_params()))

    def measure_version_mismatch(self, batch: TrainBatch, versions: list[int] | None = None,
                                 live_version: int | None = None, rows: int = 4) -> dict[str, float]:
        """routing_version_mismatch: the engine's routes against each held version's own choice, on
        this rank's first `rows` rows (versioned_routes.py; forward-only passes, collective)."""
        asked = versions if versions else ([live_version] if live_version is not None else [])
        held = [v for v in asked if v == live_version or v in self.kept_versions()]
        return {} if batch.routed_experts is None else version_mismatch(
            lambda part: self._forward_only(part, compare_engine=True, replay=False), batch, held,
            lambda v: self._versions.of(v, self._trained_params()), live_version, rows)
