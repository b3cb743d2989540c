"""The live model's weights as HF-named full tensors, bucket by bucket, on EVERY rank that owns
some: each owner converts and sends its own parameters, concurrently with the others.

    plan = build_plan(chunks, wmap)                        # collective, once per model
    senders = assign_senders(plan)                         # the same list on every rank
    for bucket in stream_owned(chunks, wmap, plan, senders, bucket_bytes):   # every rank
        transport_part.send(bucket)                        # [(hf_name, tensor), ...] on a sender

The owner of a parameter (stream.build_plan: TP / expert-TP rank 0 at DP / expert-DP rank 0, on
its pipeline stage and expert-parallel rank) is its sender, except where HF tensors must travel
together and their parameters have different owners (gpt-oss's stacked experts, spread over the
expert-parallel ranks): the group's first owner sends it, and the other owners pass it their
full tensors point to point. Every rank walks the plan in the same global order, doing only the
steps it takes part in (its TP gathers, those sends and receives), so every blocking pair of
operations meets at the same place in that order: no deadlock, and no rank waits for another's
transfers to the servers. With PP2 x EP2 on 4 ranks the 4 ranks send (2 dense owners, 4 expert
owners), where stream.stream_hf_weights funnels everything through global rank 0.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from gspo_megatron.actor.weights import full_tensor_over_tp
from gspo_megatron.parallel.comm import comm_device
from gspo_megatron.sync.stream import PlanEntry, _local_params, _takes_part, _together_key
from model_specs.weight_batches import weight_batches
from model_specs.weight_maps import ParamMapping, WeightMap


def assign_senders(plan: Sequence[PlanEntry]) -> list[int]:
    """The rank that sends each plan entry: its owner, or the first owner of its group of
    entries that must load together (stream._together_key)."""
    first: dict[str, int] = {}
    out = []
    for e in plan:
        key = _together_key(e)
        if key is not None:
            first.setdefault(key, e.owner)
        out.append(first[key] if key is not None else e.owner)
    return out


def sender_buckets(plan: Sequence[PlanEntry], senders: Sequence[int], bucket_bytes: int
                   ) -> dict[int, list[list[int]]]:
    """Per sender, its buckets as lists of plan indices (consecutive in plan order, at most
    bucket_bytes unless one group alone is larger, groups never cut)."""
    mine: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(senders):
        mine[s].append(i)
    return {s: [[i for i, _ in b] for b in weight_batches(
        [(i, plan[i]) for i in idx], lambda x: x[1].nbytes, bucket_bytes,
        lambda x: _together_key(x[1]))] for s, idx in mine.items()}


@torch.no_grad()
def stream_owned(chunks: Sequence[torch.nn.Module], wmap: WeightMap, plan: Sequence[PlanEntry],
                 senders: Sequence[int], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Collective generator (module docstring): on a sender, one item per bucket of its own, the
    bucket's (HF name, full tensor) pairs; nothing on the other ranks, which must still iterate
    it to its end (their TP gathers and point-to-point sends)."""
    rank = dist.get_rank()
    local = _local_params(chunks)
    bucket_of: dict[int, int] = {}
    pending: dict[int, int] = {}  # this rank's bucket -> entries still to come
    if rank in set(senders):
        for b, idx in enumerate(sender_buckets(plan, senders, bucket_bytes)[rank]):
            pending[b] = len(idx)
            bucket_of.update({i: b for i in idx})
    filled: dict[int, list[tuple[ParamMapping, torch.Tensor]]] = defaultdict(list)
    for i, e in enumerate(plan):
        param = local.get(e.mapping.megatron)
        sender = senders[i]
        if param is None and rank != sender:
            continue
        full = full_tensor_over_tp(param) if param is not None and _takes_part(param) else None
        if rank == sender:
            if e.owner != rank:
                full = torch.empty(e.shape, dtype=e.dtype, device=comm_device())
                dist.recv(full, src=e.owner)
            b = bucket_of[i]
            filled[b].append((e.mapping, full))
            pending[b] -= 1
            if pending[b] == 0:
                out = wmap.hf_tensors(filled.pop(b))
                yield out
        elif rank == e.owner:
            dist.send(full.contiguous(), dst=sender)
