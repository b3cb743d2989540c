"""Context parallelism (CP): megatron's load-balanced ("zig-zag") split of the sequence axis.

    local = split(t, rank, size)               # [b, s] -> [b, s / size]: this rank's 2 chunks
    full = join([split(t, r, size) for r in range(size)])      # == t
    full = all_gather(local, group)            # collective over the CP group: [b, s]

A row of `s` positions (s a multiple of 2 x size) is cut into 2 x size equal chunks; CP rank r
holds chunks r and 2 x size - 1 - r, in that order. Under a causal mask the first chunks attend to
little and the last to much, so every rank gets one cheap and one expensive chunk. It is the split
megatron's CP expects everywhere: its data loader (megatron/core/utils.py get_batch_on_this_cp_rank),
the rotary embeddings each rank applies (models/common/embeddings/rope_utils.py
get_pos_emb_on_this_cp_rank, which is why the model needs no position ids for RoPE) and Transformer
Engine's causal CP attention. tests/parallel/test_context.py compares `split` with megatron's
function.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from gspo_megatron.parallel.comm import comm_device


def _check(s: int, rank: int, size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"context-parallel rank {rank} of size {size}: expected 0 <= rank < size")
    if s % (2 * size):
        raise ValueError(f"sequence length {s} is not a multiple of 2 x context = {2 * size} "
                         "(pad the micro-batch to it)")


def positions(s: int, rank: int, size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The positions `[s / size]` of a row of `s` that CP rank `rank` holds, in its order."""
    _check(s, rank, size)
    c = s // (2 * size)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * size - 1 - rank) * c, (2 * size - rank) * c, device=device)])


def split(t: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's two chunks of `t` along `dim` (the sequence axis; `[b, s, ...]`: 1)."""
    if size == 1:
        return t
    return t.index_select(dim, positions(t.shape[dim], rank, size, device=t.device))


def join(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full tensor from every CP rank's `split`, in rank order (the inverse of split)."""
    size = len(parts)
    if size == 1:
        return parts[0]
    c = parts[0].shape[dim] // 2
    halves = [part.split(c, dim=dim) for part in parts]  # rank r held chunks r and 2 size - 1 - r
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


def all_gather(local: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """The full tensor from this rank's `split` of it (collective over the CP group; not
    differentiable). The result is on `local`'s device."""
    size = dist.get_world_size(group)
    if size == 1:
        return local
    device = comm_device(group)
    mine = local.detach().to(device).contiguous()
    parts = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(parts, mine, group=group)
    return join(parts, dim=dim).to(local.device)
