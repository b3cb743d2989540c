"""Full (one-process) megatron state dicts <-> the shards of any parallel layout.

    full = full_state_dict(chunks)            # {name: full tensor} on every rank (or rank 0)
    load_full_state_dict(chunks, full)        # the same weights into any TP/PP/VPP/EP layout

Names are megatron's parameter names with GLOBAL indices, i.e. the names a TP1/PP1/EP1 model has:
`decoder.layers.{global layer}.…` and `….experts.local_experts.{global expert}.…`, in the local
spec's spelling whichever spec built the model (TE's fused norm names and grouped experts
`….experts.linear_fc1.weight{e}` are mapped by model_specs.weights.maps.canonical_megatron_name),
so full state dicts move between a TE-spec and a local-spec model. Tensor-
parallel shards are joined the way megatron splits them (`partition_dim`, `partition_stride`: a
strided parameter, e.g. the gated fc1 [gate; up], is `stride` blocks each split over TP ranks;
`partition_blocks`: blocks of unequal sizes, a Gated DeltaNet's in_proj and conv1d), so
the full tensor is exactly what the one-process model holds. With tied embeddings the output layer
of the last stage is not listed (it is `embedding.word_embeddings.weight`).

This is the small, layout-generic helper the tests and the checkpoint/sync code share. It gathers
everything through one process group call (pickled tensors): fine for test and tiny models; large
models need the streaming path of gspo_megatron/sync.
"""
from __future__ import annotations

import re
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel

from gspo_megatron.lora.adapters import is_adapter_key
from gspo_megatron.parallel.model_chunks import unwrap
from model_specs.weights.maps import canonical_megatron_name

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_LOCAL_EXPERT = re.compile(r"^(.*\.experts\.local_experts\.)(\d+)(\..*)$")
_GROUPED_EXPERT = re.compile(r"^(.*\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")


def is_expert_param(param: torch.nn.Parameter) -> bool:
    """A routed expert's parameter (split over expert-TP, replicated over expert-DP): megatron's
    allreduce=False, which mark_expert_params sets in every layout."""
    return not getattr(param, "allreduce", True)


def mark_expert_params(model: torch.nn.Module) -> None:
    """Mark every routed expert's parameter allreduce=False, as megatron marks them only under
    expert parallelism (tensor_parallel/layers.py and transformer/moe/experts.py: `not (is_expert
    and expert_parallel)`). With EP 1 and expert-TP < TP the experts are whole on ranks that see
    different tokens: unmarked, DDP reduced their gradients over the dense data-parallel group
    instead of the expert one (one GSPO step under TP2 x ETP1 left them 6.6e-4 from one process's)
    and their full tensors were joined over TP (twice their size). Marked, DDP, the optimizer and
    the weight sync treat them as under EP; with expert-TP = TP the two groups are the same."""
    for name, param in model.named_parameters():
        if ".mlp.experts." in f".{name}":
            # read by megatron-core's DDP and optimizers; torch's Parameter does not declare it
            param.allreduce = False  # type: ignore[attr-defined]


def global_name(model: GPTModel, local_name: str) -> str:
    """The name of a parameter of `model` (one chunk, unwrapped) in the one-process model."""
    m = _LAYER.match(local_name)
    if not m:
        return local_name
    local_idx, rest = int(m.group(1)), m.group(2)
    layer = model.decoder.layers[local_idx]
    name = f"decoder.layers.{layer.layer_number - 1}.{rest}"
    e = _LOCAL_EXPERT.match(name) or _GROUPED_EXPERT.match(name)
    if e:
        indices = layer.mlp.local_expert_indices
        local_e = int(e.group(2))
        name = f"{e.group(1)}{indices[local_e]}{e.group(3) if e.re is _LOCAL_EXPERT else ''}"
    return name


def named_parameters_global(chunks: Sequence[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(global canonical name, local parameter) over all model chunks of this rank; tied copies
    skipped. Canonical: the local spec's names (model_specs.weights.maps.canonical_megatron_name),
    so that a TE-spec model and a local-spec one list the same names. LoRA adapters are not the
    model's weights and are not listed (adapter_state.py has them)."""
    for chunk in chunks:
        model = unwrap(chunk)
        for local_name, param in model.named_parameters():
            if local_name == "output_layer.weight" and model.share_embeddings_and_output_weights:
                continue
            if is_adapter_key(local_name):
                continue
            yield canonical_megatron_name(global_name(model, local_name)), param


def tp_group_of(param: torch.nn.Parameter) -> tuple[dist.ProcessGroup, int, int]:
    """(group, size, rank) of the TP group `param` is split over (expert-TP for routed experts)."""
    if is_expert_param(param):
        return ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size(), \
            ps.get_expert_tensor_parallel_rank()
    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size(), \
        ps.get_tensor_model_parallel_rank()


def is_tp_sharded(param: torch.nn.Parameter) -> bool:
    """Split over its TP group (megatron's `tensor_model_parallel` attribute)."""
    return bool(getattr(param, "tensor_model_parallel", False))


def join_tp_shards(shards: list[torch.Tensor], dim: int, stride: int,
                   blocks: list[int] | None = None) -> torch.Tensor:
    """TP shards (rank order) -> the full tensor. Each shard holds its 1/tp of each of `stride`
    consecutive blocks along `dim` (megatron's _initialize_affine_weight_cpu layout), or of each
    of the blocks of `blocks` rows (the full tensor's; a Gated DeltaNet's in_proj and conv1d,
    whose blocks differ in size: model_specs/features/gated_delta_net/layers.py)."""
    if blocks is not None:
        tp = len(shards)
        per_shard = [s.split([b // tp for b in blocks], dim=dim) for s in shards]
        return torch.cat([per_shard[r][k] for k in range(len(blocks)) for r in range(tp)], dim=dim)
    if stride == 1:
        return torch.cat(shards, dim=dim)
    per_shard = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([per_shard[r][k] for k in range(stride) for r in range(len(shards))], dim=dim)


def shard_of(full: torch.Tensor, dim: int, stride: int, tp_size: int, tp_rank: int,
             blocks: list[int] | None = None) -> torch.Tensor:
    """Inverse of join_tp_shards: rank `tp_rank`'s shard of `full`."""
    parts = full.split(blocks, dim=dim) if blocks is not None else full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(tp_size, dim=dim)[tp_rank] for b in parts], dim=dim)


def full_tensor_over_tp(param: torch.nn.Parameter) -> torch.Tensor:
    """This parameter joined over its TP group (a collective over that group)."""
    local = param.detach()
    if not is_tp_sharded(param):
        return local.clone()
    group, size, _ = tp_group_of(param)
    if size == 1:
        return local.clone()
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local.contiguous(), group=group)
    return join_tp_shards(shards, param.partition_dim,  # type: ignore[attr-defined]  # megatron-core's TP attribute
                          getattr(param, "partition_stride", 1),
                          getattr(param, "partition_blocks", None))


def owns_full_copy(param: torch.nn.Parameter) -> bool:
    """One rank per distinct tensor contributes it: DP x CP rank 0 (expert-DP rank 0 for experts;
    context-parallel ranks hold replicas like DP ranks) and TP rank 0 (expert-TP rank 0)."""
    if is_expert_param(param):
        return ps.get_expert_data_parallel_rank() == 0 and ps.get_expert_tensor_parallel_rank() == 0
    return (ps.get_data_parallel_rank(with_context_parallel=True) == 0
            and ps.get_tensor_model_parallel_rank() == 0)


def gather_owned(mine: dict[str, torch.Tensor], to_all_ranks: bool, what: str) -> dict[str, torch.Tensor] | None:
    """The union of every rank's `mine` (the full tensors it owns, on the host: the object
    collectives pickle them), sorted by name: on every rank, or on global rank 0 only (None
    elsewhere). A name two ranks own means the global naming is ambiguous for this layout."""
    pieces: list[Any] = [None] * dist.get_world_size()
    if to_all_ranks:
        dist.all_gather_object(pieces, mine)
    else:
        dist.gather_object(mine, pieces if dist.get_rank() == 0 else None, dst=0)
        if dist.get_rank() != 0:
            return None
    out: dict[str, torch.Tensor] = {}
    for piece in pieces:
        for name, tensor in piece.items():
            if name in out:
                raise RuntimeError(f"{what} {name} came from two ranks: the global naming is "
                                   "ambiguous for this layout")
            out[name] = tensor
    return dict(sorted(out.items()))


@torch.no_grad()
def full_state_dict(chunks: list[torch.nn.Module], *, to_all_ranks: bool = True
                    ) -> dict[str, torch.Tensor] | None:
    """All parameters of the model as full tensors with global names (see module docstring).

    A collective over the whole world: every rank must call it. Returns the dict on every rank, or
    with to_all_ranks=False on global rank 0 only (None elsewhere).
    """
    mine: dict[str, torch.Tensor] = {}
    for name, param in named_parameters_global(chunks):
        full = full_tensor_over_tp(param)  # every rank of the TP group takes part
        if owns_full_copy(param):
            mine[name] = full.cpu()
    return gather_owned(mine, to_all_ranks, what="parameter")


@torch.no_grad()
def load_full_state_dict(chunks: list[torch.nn.Module], full: dict[str, torch.Tensor], *,
                         strict: bool = True) -> None:
    """Copy each local parameter's shard out of `full` (global names, full tensors).

    Every rank needs `full` (at least the names it holds). strict=True raises naming missing
    parameters and shape mismatches, and (a collective over the world) names any entry of `full`
    that no rank used. With a bf16/fp16 optimizer call optimizer.reload_model_params() afterwards.
    """
    used: set[str] = set()
    problems: list[str] = []
    for chunk in chunks:
        model = unwrap(chunk)
        for local_name, param in model.named_parameters():
            if is_adapter_key(local_name):
                continue
            tied_output = local_name == "output_layer.weight" and model.share_embeddings_and_output_weights
            name = "embedding.word_embeddings.weight" if tied_output else \
                canonical_megatron_name(global_name(model, local_name))
            if name not in full:
                problems.append(f"missing {name}")
                continue
            used.add(name)
            value = full[name]
            if is_tp_sharded(param):
                _, size, rank = tp_group_of(param)
                value = shard_of(value, param.partition_dim, getattr(param, "partition_stride", 1),
                                 size, rank, getattr(param, "partition_blocks", None))
            if value.shape != param.shape:
                problems.append(f"{name}: shard shape {tuple(value.shape)} != parameter shape "
                                f"{tuple(param.shape)} (full {tuple(full[name].shape)})")
                continue
            param.data.copy_(value.to(param.dtype))
    if not strict:
        return
    all_used: list = [None] * dist.get_world_size()
    dist.all_gather_object(all_used, (sorted(used), problems))
    problems = [p for _, probs in all_used for p in probs]
    unused = set(full) - set().union(*(set(u) for u, _ in all_used))
    if unused:
        problems.append(f"unused entries (no rank holds them): {sorted(unused)}")
    if problems:
        raise ValueError("load_full_state_dict: " + "; ".join(sorted(set(problems))[:20]))
