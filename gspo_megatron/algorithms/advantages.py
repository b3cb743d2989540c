"""Group-relative advantages (GSPO Eq. 6)."""
from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """`A_i = (r_i - mean(r_group)) / (std(r_group) + eps)` for rewards ordered group by group.

    rewards: `[n]`, the G responses of query 0, then the G of query 1, ...; returns `[n]` (float).
    std is the population std of the group (the std of the set, as Eq. 6 writes it; no Bessel
    correction, so a group of one is defined). A group whose rewards are all equal gets exactly 0
    (checked by equality, not by a tiny std), so it contributes nothing to the loss and never NaN.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [n], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    n = rewards.numel()
    if n % group_size != 0:
        raise ValueError(f"{n} rewards do not split into groups of {group_size} "
                         f"({n} % {group_size} = {n % group_size})")
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    r = rewards.to(dtype).view(n // group_size, group_size)  # [groups, G]
    centered = r - r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, correction=0, keepdim=True)
    adv = centered / (std + eps)
    all_equal = (r == r[:, :1]).all(dim=1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(adv), adv).view(n)
