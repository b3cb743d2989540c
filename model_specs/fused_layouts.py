"""Fused HF <-> megatron-core tensor layouts: where megatron holds in one tensor what HF holds in
several (or in another order), the functions that go one way and back, bit-exact. The table of
which parameter uses which is weight_maps.py.
"""
from __future__ import annotations

import torch

from gspo_megatron import InputError


class WeightMapError(InputError, ValueError):
    """A checkpoint or model that does not match the weight map; the message names the tensor."""


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
             num_query_groups: int, head_dim: int) -> torch.Tensor:
    """HF q [np*hn, ...], k/v [ng*hn, ...] -> megatron [ng*(np/ng+2)*hn, ...] (per group q,k,v)."""
    ng, rest = num_query_groups, tuple(q.shape[1:])
    _check_rows("q_proj", q, num_heads * head_dim)
    _check_rows("k_proj", k, ng * head_dim)
    _check_rows("v_proj", v, ng * head_dim)
    per_group = num_heads // ng * head_dim
    parts = [q.reshape(ng, per_group, *rest), k.reshape(ng, head_dim, *rest),
             v.reshape(ng, head_dim, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_query_groups: int,
              head_dim: int) -> list[torch.Tensor]:
    """Inverse of fuse_qkv: megatron linear_qkv -> [q, k, v] in HF layout."""
    ng, rest = num_query_groups, tuple(qkv.shape[1:])
    per_group = num_heads // ng * head_dim
    _check_rows("linear_qkv", qkv, ng * (per_group + 2 * head_dim))
    q, k, v = torch.split(qkv.reshape(ng, per_group + 2 * head_dim, *rest),
                          [per_group, head_dim, head_dim], dim=1)
    return [q.contiguous().reshape(-1, *rest), k.contiguous().reshape(-1, *rest),
            v.contiguous().reshape(-1, *rest)]


def _check_rows(name: str, t: torch.Tensor, rows: int) -> None:
    if t.dim() == 0 or t.shape[0] != rows:
        raise WeightMapError(f"{name} has shape {tuple(t.shape)}, expected {rows} rows")
