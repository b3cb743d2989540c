"""Fused HF <-> megatron-core tensor layouts: where megatron holds in one tensor what HF holds in
several (or in another order), the functions that go one way and back, bit-exact. The table of
which parameter uses which: the features' weight rules (rules.py, maps.py).

- `linear_qkv` (attention.py, get_query_key_value_tensors): per query group g, the rows are
  [q heads of g (np/ng x hn), k_g (hn), v_g (hn)]; HF's repeat_kv gives query head h the key/value
  head h // (np/ng), so the query heads of group g are HF heads g*np/ng ... (g+1)*np/ng - 1. With
  an output gate (Qwen3-Next: attention_output_gate) the rows of group g are [q heads of g, their
  gates, k_g, v_g] (the same function), where HF's q_proj holds each head's query then its
  gate (modeling_qwen3_next.py, Qwen3NextAttention: view(..., np, 2 hn), chunk in 2). A TP rank
  holds a contiguous run of whole groups, so the TP shards concatenate along dim 0.
- A Gated DeltaNet's `in_proj` (megatron/core/ssm/gated_delta_net.py, forward: the split after
  in_proj) is [q (nk x hk), k (nk x hk), v (nv x hv), z (nv x hv), beta (nv), alpha (nv)]; HF's
  in_proj_qkvz holds, per key head g, [q_g, k_g, v and z of g's nv/nk value heads], and in_proj_ba
  per key head [beta, alpha of its value heads] (Qwen3NextGatedDeltaNet.
  fix_query_key_value_ordering). Both keep value head i on key head i // (nv/nk). A TP rank holds
  1/tp of each of the six blocks (GDN_IN_PROJ_BLOCKS; actor/weights/full.py joins them so).
"""
from __future__ import annotations

import torch

from gspo_errors import InputError


class WeightMapError(InputError, ValueError):
    """A checkpoint or model that does not match the weight map; the message names the tensor."""


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
             num_query_groups: int, head_dim: int, gated: bool = False) -> torch.Tensor:
    """HF q [np*hn (x2 gated), ...], k/v [ng*hn, ...] -> megatron [ng*(np/ng(x2)+2)*hn, ...]
    (per group q(, gate), k, v)."""
    ng, rest = num_query_groups, tuple(q.shape[1:])
    _check_rows("q_proj", q, num_heads * head_dim * (2 if gated else 1))
    _check_rows("k_proj", k, ng * head_dim)
    _check_rows("v_proj", v, ng * head_dim)
    per_group = num_heads // ng * head_dim
    if gated:  # [np, (q, gate), hn] -> per group [q heads; gate heads]
        heads = q.reshape(num_heads, 2, head_dim, *rest)
        q = torch.cat([heads[:, 0].reshape(ng, per_group, *rest),
                       heads[:, 1].reshape(ng, per_group, *rest)], dim=1)
        per_group *= 2
    parts = [q.reshape(ng, per_group, *rest), k.reshape(ng, head_dim, *rest),
             v.reshape(ng, head_dim, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_query_groups: int,
              head_dim: int, gated: bool = False) -> list[torch.Tensor]:
    """Inverse of fuse_qkv: megatron linear_qkv -> [q, k, v] in HF layout."""
    ng, rest = num_query_groups, tuple(qkv.shape[1:])
    per_group = num_heads // ng * head_dim * (2 if gated else 1)
    _check_rows("linear_qkv", qkv, ng * (per_group + 2 * head_dim))
    q, k, v = torch.split(qkv.reshape(ng, per_group + 2 * head_dim, *rest),
                          [per_group, head_dim, head_dim], dim=1)
    if gated:  # per group [q heads; gate heads] -> [np, (q, gate), hn]
        query, gate = q.reshape(ng, 2, num_heads // ng, head_dim, *rest).unbind(1)
        q = torch.stack([query.reshape(num_heads, head_dim, *rest),
                         gate.reshape(num_heads, head_dim, *rest)], dim=1)
    return [q.contiguous().reshape(-1, *rest), k.contiguous().reshape(-1, *rest),
            v.contiguous().reshape(-1, *rest)]


def gdn_in_proj_blocks(nk: int, hk: int, nv: int, hv: int) -> list[int]:
    """The row counts of a Gated DeltaNet in_proj's blocks: q, k, v, z, beta, alpha."""
    return [nk * hk, nk * hk, nv * hv, nv * hv, nv, nv]


def fuse_gdn_in_proj(qkvz: torch.Tensor, ba: torch.Tensor, nk: int, hk: int, nv: int,
                     hv: int) -> torch.Tensor:
    """HF in_proj_qkvz [nk*(2hk + 2(nv/nk)hv), h] and in_proj_ba [2nv, h] -> megatron in_proj
    [q; k; v; z; beta; alpha] (module docstring)."""
    r, rest = nv // nk, tuple(qkvz.shape[1:])
    _check_rows("in_proj_qkvz", qkvz, nk * (2 * hk + 2 * r * hv))
    _check_rows("in_proj_ba", ba, 2 * nv)
    q, k, v, z = torch.split(qkvz.reshape(nk, 2 * hk + 2 * r * hv, *rest), [hk, hk, r * hv, r * hv], 1)
    b, a = torch.split(ba.reshape(nk, 2 * r, *rest), [r, r], 1)
    return torch.cat([t.reshape(-1, *rest) for t in (q, k, v, z, b, a)], dim=0)


def split_gdn_in_proj(in_proj: torch.Tensor, nk: int, hk: int, nv: int,
                      hv: int) -> list[torch.Tensor]:
    """Inverse of fuse_gdn_in_proj: megatron in_proj -> [in_proj_qkvz, in_proj_ba]."""
    r, rest = nv // nk, tuple(in_proj.shape[1:])
    _check_rows("in_proj", in_proj, sum(gdn_in_proj_blocks(nk, hk, nv, hv)))
    q, k, v, z, b, a = torch.split(in_proj, gdn_in_proj_blocks(nk, hk, nv, hv), dim=0)
    qkvz = torch.cat([q.reshape(nk, hk, *rest), k.reshape(nk, hk, *rest),
                      v.reshape(nk, r * hv, *rest), z.reshape(nk, r * hv, *rest)], dim=1)
    ba = torch.cat([b.reshape(nk, r, *rest), a.reshape(nk, r, *rest)], dim=1)
    return [qkvz.reshape(-1, *rest).contiguous(), ba.reshape(-1, *rest).contiguous()]


def _check_rows(name: str, t: torch.Tensor, rows: int) -> None:
    if t.dim() == 0 or t.shape[0] != rows:
        raise WeightMapError(f"{name} has shape {tuple(t.shape)}, expected {rows} rows")
