"""Predicted weight-sync seconds of a layout: the plan's `senders`, `sync s`, `delta s` and
`rank0 s` columns.

With sync.senders=owners every rank that holds whole tensors after the tensor-parallel /
expert-tensor-parallel gather sends its own to the servers, concurrently (gspo_megatron/sync/
stream.py). A dense parameter's owner is TP rank 0 at DP rank 0 of its pipeline stage; a routed
expert's is the owner of its (pipeline stage, EP rank). The dense owner of a stage is also its EP
rank 0's expert owner, so PP x EP ranks send and the busiest holds its stage's dense parameters
and its experts. Bytes are in the served dtype (bf16: 2 per parameter).

    sync  = max(largest sender's bytes / bandwidth, all bytes / (server GPUs x bandwidth))
    delta = sync x delta_bytes_per_element(changed) / bytes per element
    rank0 = all bytes / bandwidth        (sync.senders=rank0: everything through one rank)

Bandwidth is per GPU, the same for a sending trainer GPU and a receiving server GPU.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gspo_megatron.lora.lora_settings import LoraSettings
from gspo_megatron.parallel.layout import ParallelLayout
from gspo_megatron.planner.memory import Model, stage_params

# One 400 Gb/s NIC per H100 (50 GB/s line rate), about half of it reached end to end.
SYNC_GBPS = 25.0
# A changed fraction above what benchmarks/sync.py measures at the paper's learning rate (1e-6).
SYNC_CHANGED = 0.05
INDEX_BYTES = 4        # an int32 flat index per changed element (gspo_megatron/sync/delta.py)
BITMASK_BYTES = 1 / 8  # one bit per element


@dataclass(frozen=True)
class SyncSettings:
    """What the sync time depends on beyond the model and the layout (the plan's --sync-* flags)."""

    gbps: float = SYNC_GBPS
    """GB/s (1e9 bytes) per sending GPU, and per server GPU for the servers' ingest."""
    server_gpus: int | None = None
    """Server GPUs that ingest the weights; None: as many as the trainer's."""
    changed: float = SYNC_CHANGED
    """Fraction of the elements that change per step in the served dtype (sync/changed_fraction)."""
    served_bytes: int = 2
    """Bytes per parameter in the served dtype (bf16)."""
    lora: LoraSettings | None = None
    """A LoRA run (rank > 0) syncs its adapters alone, whole, from rank 0 (sync/adapter_sync.py)."""


@dataclass(frozen=True)
class SyncEstimate:
    senders: int
    """Ranks that send (PP x EP)."""
    sender_bytes: int
    """Bytes of the sender that holds the most."""
    total_bytes: int
    """Bytes of the whole model."""
    sync_s: float
    """A full sync, every owner sending its own."""
    delta_s: float
    """A delta sync, every owner sending what changed."""
    rank0_s: float
    """A full sync through trainer rank 0 alone."""


def delta_bytes_per_element(changed: float, value_bytes: int = 2) -> float:
    """Bytes per element of a delta: the changed values plus the cheaper of their int32 indices
    and a bitmask, never more than the whole tensor (gspo_megatron/sync/delta.py)."""
    return min(value_bytes, changed * value_bytes + min(INDEX_BYTES * changed, BITMASK_BYTES))


def sender_params(spec: Model, layout: ParallelLayout) -> list[tuple[int, int]]:
    """(dense, expert) parameters each pipeline stage's owners send: the stage's dense
    parameters whole (its EP rank 0 sends them) and one EP rank's experts whole. A tied output
    layer's copy on the last stage is left out (the checkpoint holds the embedding once)."""
    whole = dataclasses.replace(layout, tensor=1, expert_tensor=1)
    out = []
    for r in range(layout.pipeline):
        dense, expert = stage_params(spec, whole, r)
        if spec.share_embeddings_and_output_weights and layout.pipeline > 1 and r == layout.pipeline - 1:
            dense -= spec.vocab_size * spec.config.hidden_size
        out.append((dense, expert))
    return out


def sync_time(spec: Model, layout: ParallelLayout, world: int, s: SyncSettings) -> SyncEstimate:
    """The predicted seconds of a full, a delta and a rank-0 sync of `layout` (module docstring);
    a LoRA run's: its adapters whole, rank 0 to each server, the same in every column."""
    b = s.served_bytes
    if s.lora is not None and s.lora.enabled:
        from gspo_megatron.planner.lora_params import model_adapter_params
        total = model_adapter_params(spec.config, s.lora) * b
        t = total / (s.gbps * 1e9)
        return SyncEstimate(senders=1, sender_bytes=total, total_bytes=total, sync_s=t, delta_s=t, rank0_s=t)
    stages = sender_params(spec, layout)
    largest = max(d + e for d, e in stages) * b
    total = sum(d + layout.expert * e for d, e in stages) * b
    rate = s.gbps * 1e9
    full = max(largest / rate, total / ((s.server_gpus or world) * rate))
    return SyncEstimate(senders=layout.pipeline * layout.expert, sender_bytes=largest, total_bytes=total,
                        sync_s=full, delta_s=full * delta_bytes_per_element(s.changed, b) / b,
                        rank0_s=total / rate)
