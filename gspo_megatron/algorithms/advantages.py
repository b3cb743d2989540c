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


def turn_advantages(turn_rewards: list[list[float]], group_size: int, discount: float = 1.0,
                    eps: float = 1e-6) -> list[list[float]]:
    """Per-turn advantages of multi-turn episodes from per-turn rewards (GSPO-token's A_{i,t}).

    turn_rewards[i][k]: the environment's reward after model turn k of episode i (episodes ordered
    group by group, as for group_advantages). The rule, with G_{i,k} the return from turn k on:

        G_{i,k} = sum_{m >= k} discount^(m - k) r_{i,m}
        A_{i,k} = (G_{i,k} - mean_j G_{j,1}) / (std_j G_{j,1} + eps)      (j over i's group)

    i.e. a turn is credited with the rewards that came after it, centred and scaled by the group's
    episode returns (Eq. 6 on G_{·,1}). Every token of model turn k gets A_{i,k}. A group whose
    episode returns are all equal gets 0 everywhere (as group_advantages). With one reward at the
    end of each episode and discount 1, G_{i,k} = R_i for every k, so A_{i,k} = A_i: GSPO-token
    then equals GSPO.
    """
    n = len(turn_rewards)
    if n % group_size:
        raise ValueError(f"{n} episodes do not split into groups of {group_size}")
    returns = []
    for rewards in turn_rewards:
        g, acc = [0.0] * len(rewards), 0.0
        for k in range(len(rewards) - 1, -1, -1):
            acc = rewards[k] + discount * acc
            g[k] = acc
        returns.append(g)
    out = []
    for start in range(0, n, group_size):
        group = returns[start:start + group_size]
        firsts = torch.tensor([g[0] if g else 0.0 for g in group], dtype=torch.float64)
        equal = bool((firsts == firsts[0]).all())
        mu, sigma = float(firsts.mean()), float(firsts.std(correction=0))
        out += [[0.0 if equal else (x - mu) / (sigma + eps) for x in g] for g in group]
    return out
