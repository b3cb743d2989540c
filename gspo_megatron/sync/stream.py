"""The live model's weights as HF-named full tensors, bucket by bucket, on every rank that sends:
the stream every weight sync walks (sender_pass.py), and what reads the whole model on rank 0.

    plan = build_plan(chunks, wmap)                        # collective, once per model
    senders = assign_senders(plan)                         # the same list on every rank
    for bucket in stream_owned(chunks, wmap, plan, senders, bucket_bytes):   # every rank
        ...                                                # [(hf_name, tensor), ...] on a sender
    state = hf_state_dict(chunks, wmap)                    # every HF tensor, on rank 0

The plan lists the model's megatron parameters in HF order (the family's weight map), each with
the global rank that owns its full tensor: TP rank 0 and DP rank 0 of the parameter's group
(expert-TP / expert-DP for experts), on whichever pipeline stage (and virtual stage) holds it.
The owner of a parameter is its sender, except where HF tensors must travel together and their
parameters have different owners (gpt-oss's stacked experts, spread over the expert-parallel
ranks): the group's first owner sends it, and the other owners pass it their full tensors point
to point. With `only=0` (sync.senders=rank0) rank 0 is every parameter's sender: the same stream,
every owner passing its tensors to rank 0. Every rank walks the plan in the same global order,
doing only the steps it takes part in (its TP gathers, those sends and receives), so every
blocking pair of operations meets at the same place in that order: no deadlock, and no rank waits
for another's transfers to the servers. A sender holds at most one bucket of full tensors, any
other rank at most the one parameter it is passing on. With PP2 x EP2 on 4 ranks the 4 ranks
send (2 dense owners, 4 expert owners).
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from gspo_megatron.actor.weights.full import (full_tensor_over_tp, is_expert_param, named_parameters_global,
                                         owns_full_copy)
from gspo_megatron.parallel.comm import comm_device
from model_specs.weights.batches import weight_batches
from model_specs.weights.maps import ParamMapping, WeightMap, WeightMapError


@dataclass(frozen=True)
class PlanEntry:
    """One megatron parameter of the model: who owns its full tensor, and its size."""

    mapping: ParamMapping
    owner: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        tp = (ps.get_expert_tensor_parallel_world_size() if is_expert_param(param)
              else ps.get_tensor_model_parallel_world_size())
        # set by megatron-core's set_tensor_model_parallel_attributes; torch's Parameter does not declare it
        shape[param.partition_dim] *= tp  # type: ignore[attr-defined]
    return tuple(shape)


def _local_params(chunks: Sequence[torch.nn.Module]) -> dict[str, torch.nn.Parameter]:
    """Global weight-map name -> this rank's parameter (tied output copies left out)."""
    return dict(named_parameters_global(chunks))  # canonical names (the weight map's)


def _takes_part(param: torch.nn.Parameter) -> bool:
    """This rank's TP group is the one that assembles the parameter (DP x CP / expert-DP rank 0)."""
    if is_expert_param(param):
        return ps.get_expert_data_parallel_rank() == 0
    return ps.get_data_parallel_rank(with_context_parallel=True) == 0


def build_plan(chunks: Sequence[torch.nn.Module], wmap: WeightMap) -> list[PlanEntry]:
    """Collective over the world. Raises WeightMapError if the model and the map disagree."""
    mine = [(name, _full_shape(p), p.dtype) for name, p in _local_params(chunks).items()
            if owns_full_copy(p)]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    owners: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
    for rank, items in enumerate(everyone):
        for name, shape, dtype in items:
            if name in owners:
                raise WeightMapError(f"parameter {name} is owned by ranks {owners[name][0]} and "
                                     f"{rank}: the global naming is ambiguous for this layout")
            owners[name] = (rank, shape, dtype)
    plan, missing = [], []
    for m in wmap.mappings():
        if m.megatron in owners:
            plan.append(PlanEntry(m, *owners.pop(m.megatron)))
        else:
            missing.append(m.megatron)
    if missing or owners:
        raise WeightMapError(f"the {wmap.family} weight map and the live model differ: no rank "
                             f"holds {missing[:10]}; unmapped parameters {sorted(owners)[:10]}")
    return plan


# HF tensors that SGLang must receive in one load call: DeepSeek-V2/V3's loader fuses a layer's
# q_a_proj and kv_a_proj_with_mqa into one parameter and keeps the first of the two only until the
# call returns (sglang 0.5 deepseek_weight_loader.DeepseekV2WeightLoaderMixin.do_load_weights, its
# cached_a_proj), so a bucket boundary between them silently leaves that layer's old weights on the server.
LOAD_TOGETHER = re.compile(r"^(model\.layers\.\d+)\.self_attn\.(?:q_a_proj|kv_a_proj_with_mqa)\.weight$")


def _together_key(e: PlanEntry) -> str | None:
    """What `e` must share a bucket with: the other experts of its stacked HF tensor (gpt-oss:
    one tensor per layer holds every expert, WeightMap.together_key), or LOAD_TOGETHER's partner."""
    stacked = WeightMap.together_key(e.mapping)
    if stacked is not None:
        return stacked
    for name in e.mapping.hf:
        m = LOAD_TOGETHER.match(name)
        if m:
            return m.group(1)
    return None


def buckets(plan: Sequence[PlanEntry], bucket_bytes: int) -> list[list[PlanEntry]]:
    """Consecutive plan entries of at most `bucket_bytes` (a larger parameter is a bucket alone),
    never cut between two entries that must load together (_together_key): their bucket grows."""
    return list(weight_batches(plan, lambda e: e.nbytes, bucket_bytes, _together_key))


def assign_senders(plan: Sequence[PlanEntry], only: int | None = None) -> list[int]:
    """The rank that sends each plan entry: `only` for every entry when given, else its owner, or
    the first owner of its group of entries that must load together (_together_key)."""
    if only is not None:
        return [only] * len(plan)
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
            if full is None:
                raise RuntimeError(f"rank {rank} sends {e.mapping.megatron} but received no full tensor of it")
            b = bucket_of[i]
            filled[b].append((e.mapping, full))
            pending[b] -= 1
            if pending[b] == 0:
                yield wmap.hf_tensors(filled.pop(b))
        elif rank == e.owner:
            if full is None:
                raise RuntimeError(f"rank {rank} owns {e.mapping.megatron} but holds no full tensor of it")
            dist.send(full.contiguous(), dst=sender)


def stream_hf_weights(chunks: Sequence[torch.nn.Module], wmap: WeightMap,
                      plan: Sequence[PlanEntry], bucket_bytes: int
                      ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Collective generator: every HF tensor of the model on global rank 0, bucket by bucket
    (stream_owned with rank 0 the only sender); nothing on the other ranks, which must still
    iterate it to its end."""
    return stream_owned(chunks, wmap, plan, assign_senders(plan, only=0), bucket_bytes)


def hf_state_dict(chunks: Sequence[torch.nn.Module], wmap: WeightMap) -> dict[str, torch.Tensor] | None:
    """Collective: every HF tensor of the live model on global rank 0 (None elsewhere)."""
    plan = build_plan(chunks, wmap)
    out = {n: t for bucket in stream_hf_weights(chunks, wmap, plan, 1 << 62) for n, t in bucket}
    return out if dist.get_rank() == 0 else None
