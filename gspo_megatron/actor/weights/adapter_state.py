"""The adapters as one-process (full) tensors <-> their shards in any layout.

    full = full_adapter_state_dict(chunks)          # {global name: full tensor} (collective)
    load_full_adapter_state_dict(chunks, full)      # the same adapters into any TP/PP/EP layout

Names are the adapters' parameter names with global layer indices (gspo_megatron/lora/merge.py
lists them). A linear layer's adapter joins over TP like any parameter (its partition attributes:
attach.py); a layer's routed-expert tensors [E_local, ...] join over the expert-parallel ranks
along dim 0 (EP rank k holds experts k * E_local ...), except those shared by every expert
(`shared_outer`), which each rank holds whole. Adapters are small (rank x width per layer), so the
object collective of weights.py serves them at any model size.
"""
from __future__ import annotations


import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from gspo_megatron.actor.weights.full import gather_owned, is_tp_sharded, join_tp_shards, shard_of, tp_group_of
from gspo_megatron.lora.attach import named_adapters
from gspo_megatron.parallel.model_chunks import unwrap


def named_adapters_global(chunks: list[torch.nn.Module]) -> list[tuple[str, torch.nn.Parameter]]:
    """(global name, local parameter) of this rank's adapters, in model order."""
    return [(name, p) for c in chunks for _, name, p in named_adapters(unwrap(c))]


def _stacked(param: torch.nn.Parameter) -> bool:
    """Local experts' tensors stacked on dim 0, joined over EP (attach.py sets `expert_stacked`)."""
    return bool(getattr(param, "expert_stacked", False))


def _owns(param: torch.nn.Parameter) -> bool:
    """The one rank whose copy of the full tensor is kept: EP rank 0 of expert-DP rank 0 for the
    experts' stacked tensors (joined over EP), else DP x CP rank 0 at TP rank 0 (every other
    adapter is whole or TP-split on each rank of a stage, a shared-outer one too)."""
    if _stacked(param):
        return ps.get_expert_data_parallel_rank() == 0 and ps.get_expert_model_parallel_rank() == 0
    return (ps.get_data_parallel_rank(with_context_parallel=True) == 0
            and ps.get_tensor_model_parallel_rank() == 0)


def _full(param: torch.nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """`local` (the parameter, or a tensor of its local shape: its gradient) joined over TP and,
    for per-expert tensors, over EP (a collective over those groups)."""
    full = local.detach().clone()
    if is_tp_sharded(param):
        group, size, _ = tp_group_of(param)
        if size > 1:
            shards = [torch.empty_like(full) for _ in range(size)]
            dist.all_gather(shards, full.contiguous(), group=group)
            full = join_tp_shards(shards, getattr(param, "partition_dim"), getattr(param, "partition_stride", 1))
    if _stacked(param) and ps.get_expert_model_parallel_world_size() > 1:
        group = ps.get_expert_model_parallel_group()
        parts = [torch.empty_like(full) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, full.contiguous(), group=group)
        full = torch.cat(parts, dim=0)
    return full


@torch.no_grad()
def full_adapter_state_dict(chunks: list[torch.nn.Module], *, grads: bool = False,
                            to_all_ranks: bool = True) -> dict[str, torch.Tensor] | None:
    """Every adapter as a full tensor with its global name (module docstring); grads: their
    gradients after the step's reductions (`main_grad`, DDP's buffer) instead of their values.
    A collective over the world; the dict on every rank, or on rank 0 only (to_all_ranks=False)."""
    mine: dict[str, torch.Tensor] = {}
    for name, param in named_adapters_global(chunks):
        value = getattr(param, "main_grad", None) if grads else param
        if value is None:
            raise RuntimeError(f"{name} has no main_grad: no backward has run (or it is not trained)")
        full = _full(param, value)
        if _owns(param):
            mine[name] = full.cpu()
    return gather_owned(mine, to_all_ranks, what="adapter")


@torch.no_grad()
def load_full_adapter_state_dict(chunks: list[torch.nn.Module], full: dict[str, torch.Tensor]) -> None:
    """Copy each local adapter's shard out of `full` (global names, full tensors; every rank
    passes it). ValueError naming what is missing, of another shape, or held by no rank."""
    used: set[str] = set()
    problems: list[str] = []
    for name, param in named_adapters_global(chunks):
        if name not in full:
            problems.append(f"missing {name}")
            continue
        used.add(name)
        value = full[name]
        if _stacked(param) and ps.get_expert_model_parallel_world_size() > 1:
            n = param.shape[0]
            start = ps.get_expert_model_parallel_rank() * n
            value = value[start:start + n]
        if is_tp_sharded(param):
            _, size, rank = tp_group_of(param)
            value = shard_of(value, getattr(param, "partition_dim"), getattr(param, "partition_stride", 1), size, rank)
        if value.shape != param.shape:
            problems.append(f"{name}: shard shape {tuple(value.shape)} != parameter shape "
                            f"{tuple(param.shape)} (full {tuple(full[name].shape)})")
            continue
        param.data.copy_(value.to(param.dtype))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sorted(used), problems))
    problems = sorted({p for _, probs in everyone for p in probs})
    unused = set(full) - set().union(*(set(u) for u, _ in everyone))
    if unused:
        problems.append(f"unused entries (no rank holds them): {sorted(unused)}")
    if problems:
        raise ValueError("load_full_adapter_state_dict: " + "; ".join(problems[:20]))
