"""The live model's weights as HF-named FULL tensors, bucket by bucket, on global rank 0.

    plan = build_plan(chunks, wmap)                       # collective, once per model
    for bucket in stream_hf_weights(chunks, wmap, plan, bucket_bytes=256 << 20):   # collective
        if rank == 0: transport.send(bucket)              # [(hf_name, tensor), ...]; [] elsewhere

Every trainer rank iterates the generator to its end, in step. The plan lists the model's megatron
parameters in HF order (the family's weight map), each with the global rank that owns its full
tensor: TP rank 0 and DP rank 0 of the parameter's group (expert-TP / expert-DP for experts), on
whichever pipeline stage (and virtual stage) holds it. For each parameter of a bucket, the ranks
holding it join its TP (or expert-TP) shards, the owner sends the result to rank 0 point to point,
and rank 0 turns the bucket's full megatron tensors into HF tensors (weight map). All ranks walk the
same global order, so the collectives and sends/receives pair up without deadlock; rank 0 holds at
most one bucket of full tensors, any other rank at most the one parameter it is sending.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from gspo_megatron.actor.weights import (full_tensor_over_tp, is_expert_param, named_parameters_global,
                                         owns_full_copy)
from gspo_megatron.parallel.comm import comm_device
from model_specs.weight_batches import weight_batches
from model_specs.weight_maps import ParamMapping, WeightMap, WeightMapError


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
        shape[param.partition_dim] *= tp
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
# call returns (sglang/srt/models/deepseek_common/deepseek_weight_loader.py:283 and :438-459), so a
# bucket boundary between them silently leaves that layer's old weights on the server.
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


@torch.no_grad()
def stream_hf_weights(chunks: Sequence[torch.nn.Module], wmap: WeightMap,
                      plan: Sequence[PlanEntry], bucket_bytes: int
                      ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Collective generator (see the module docstring): one item per bucket on every rank, the
    bucket's (HF name, full tensor) pairs on global rank 0 and [] elsewhere."""
    rank = dist.get_rank()
    local = _local_params(chunks)
    for bucket in buckets(plan, bucket_bytes):
        received: list[tuple[ParamMapping, torch.Tensor]] = []
        for e in bucket:
            param = local.get(e.mapping.megatron)
            full = full_tensor_over_tp(param) if param is not None and _takes_part(param) else None
            if rank == 0:
                if e.owner != 0:
                    full = torch.empty(e.shape, dtype=e.dtype, device=comm_device())
                    dist.recv(full, src=e.owner)
                received.append((e.mapping, full))
            elif rank == e.owner:
                dist.send(full.contiguous(), dst=0)
        out = wmap.hf_tensors(received) if rank == 0 else []
        del received
        yield out


def hf_state_dict(chunks: Sequence[torch.nn.Module], wmap: WeightMap) -> dict[str, torch.Tensor] | None:
    """Collective: every HF tensor of the live model on global rank 0 (None elsewhere)."""
    plan = build_plan(chunks, wmap)
    out = {n: t for bucket in stream_hf_weights(chunks, wmap, plan, 1 << 62) for n, t in bucket}
    return out if dist.get_rank() == 0 else None
