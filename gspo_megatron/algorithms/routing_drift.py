"""Routing drift of MoE layers: how many (token, layer) top-k expert sets change between two
policies (GSPO paper §5.3: about 10% after one update on a 48-layer MoE, which is why GRPO's token
ratios turn into noise there and GSPO's sequence ratios do not). Pure torch.

    changed = changed_expert_sets(old_topk, new_topk)        # [n] bool, order within a set ignored
    fraction = changed[trained].float().mean()
"""
from __future__ import annotations

import torch


def changed_expert_sets(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """[..., k] expert indices of two routings of the same tokens -> [...] bool: the top-k SET
    differs (the order of the k experts does not matter)."""
    if old.shape != new.shape:
        raise ValueError(f"routings of shape {tuple(old.shape)} and {tuple(new.shape)} differ")
    return (old.sort(dim=-1).values != new.sort(dim=-1).values).any(dim=-1)


def drift_counts(old: torch.Tensor, new: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(changed sets, compared sets) over the tokens where `mask` is True; old/new: [..., k],
    mask: [...]. Tokens without an old routing (index -1 anywhere) are not compared."""
    have = mask.bool() & (old >= 0).all(dim=-1) & (new >= 0).all(dim=-1)
    changed = changed_expert_sets(old, new) & have
    return changed.sum(), have.sum()
