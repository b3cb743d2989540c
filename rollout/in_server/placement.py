"""Where each element of an HF tensor lives on an SGLang server (rollout/in_server/weight_loader.py applies
deltas and checksums with it).

SGLang's own loaders take whole HF tensors (`model.load_weights([(hf_name, tensor)])`) and place
them into the server's fused, TP-sharded parameters (qkv_proj, gate_up_proj, experts.w13_weight,
...). A delta is a few elements of an HF tensor, so the probe finds where each HF element lives on
this server with the model's own load_weights: it swaps the candidate parameters' data for
float64 tensors full of NaN, loads float64 tensors whose elements are their own positions, reads
back which server element received which HF element, and restores the parameters. Then the
changed elements are written in place (apply_sparse; bit for bit: they arrive in the served
dtype). This holds for loaders that place elements (copy, slice, transpose, concatenate: every
family we serve); a loader that computes on values makes the probe fail with a named error
(non-integer or missing positions), which the sync reports and fails with, rather than serve
something else.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import torch

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class NotPositional(RuntimeError):
    """The model's loader does not place HF elements one to one: deltas cannot be applied."""


def own_load_weights(model: torch.nn.Module):
    """The model's own load_weights (route_load_weights in weight_loader.py keeps it aside)."""
    return getattr(model, "gspo_own_load_weights", None) or model.load_weights


def _layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


@dataclass
class Part:
    """Some of an HF tensor's elements in one server parameter: HF flat indices lo..hi-1 at the
    parameter's flat positions offset+lo..offset+hi-1 (a block: `pos` and `hf` None), or at the
    explicit positions `pos` holding the HF indices `hf`."""

    param: str
    shape: tuple[int, ...]
    offset: int = 0
    lo: int = 0
    hi: int = 0
    pos: torch.Tensor | None = None
    hf: torch.Tensor | None = None


@dataclass
class Placement:
    """Where one HF tensor's elements are on this server."""

    numel: int
    parts: list[Part] = field(default_factory=list)


# HF name -> its placement when every part is a block (a few integers): probed once per server
# process. Where a loader scatters (explicit positions) the probe runs at every use instead,
# rather than keeping 8-16 bytes per element on the server.
_PLACEMENTS: dict[str, Placement] = {}


def _as_parts(pname: str, shape: tuple[int, ...], pos: torch.Tensor, hf: torch.Tensor) -> Part:
    order = torch.argsort(hf)
    pos, hf = pos[order], hf[order]
    lo, hi = int(hf[0]), int(hf[-1]) + 1
    offset = int(pos[0]) - lo
    if hi - lo == hf.numel() and torch.equal(pos - hf, torch.full_like(pos, offset)):
        return Part(pname, shape, offset, lo, hi)
    return Part(pname, shape, pos=pos, hf=hf)


@torch.no_grad()
def probe(model: torch.nn.Module, shapes: dict[str, Sequence[int]]) -> dict[str, Placement]:
    """The placement of each HF tensor of `shapes`, found with the model's own load_weights on
    float64 position tensors, one layer's tensors at a time (module docstring); block placements
    come from _PLACEMENTS after the first time."""
    params = dict(model.named_parameters())
    out: dict[str, Placement] = {}
    by_layer: dict[int | None, list[str]] = defaultdict(list)
    for name, shape in shapes.items():
        known = _PLACEMENTS.get(name)
        if known is not None and known.numel == math.prod(shape) and all(
                tuple(params[p.param].shape) == p.shape for p in known.parts if p.param in params):
            out[name] = known
        else:
            by_layer[_layer_of(name)].append(name)
    for layer, names in by_layer.items():
        candidates = [(n, p) for n, p in params.items() if _layer_of(n) == layer]
        device = candidates[0][1].device if candidates else torch.device("cpu")
        offsets, tensors, start = {}, [], 0
        for n in names:
            numel = math.prod(shapes[n])
            offsets[n] = (start, numel)
            tensors.append((n, torch.arange(start, start + numel, dtype=torch.float64,
                                            device=device).reshape(tuple(shapes[n]))))
            start += numel
        if start >= 1 << 53:
            raise NotPositional(f"layer {layer}: {start} elements are too many for a float64 probe")
        saved = [(p, p.data) for _, p in candidates]
        found = []
        try:
            for p, data in saved:
                p.data = torch.full(data.shape, math.nan, dtype=torch.float64, device=data.device)
            own_load_weights(model)(tensors)
            for pname, p in candidates:
                flat = p.data.reshape(-1)
                pos = (~torch.isnan(flat)).nonzero().reshape(-1)
                if pos.numel():
                    found.append((pname, tuple(p.shape), pos, flat[pos]))
        finally:
            for p, data in saved:
                p.data = data
        for n in names:
            out[n] = Placement(offsets[n][1])
        for pname, shape, pos, vals in found:
            if not torch.equal(vals, vals.floor()) or vals.min() < 0 or vals.max() >= start:
                raise NotPositional(f"the loader computes on values for {pname} (not a placement)")
            for n in names:
                lo, numel = offsets[n]
                mine = (vals >= lo) & (vals < lo + numel)
                if mine.any():
                    out[n].parts.append(_as_parts(pname, shape, pos[mine], (vals[mine] - lo).to(torch.int64)))
        for n in names:
            if all(p.pos is None for p in out[n].parts):
                _PLACEMENTS[n] = out[n]
    return out


@torch.no_grad()
def _hf_of(part: Part) -> torch.Tensor:
    """The HF flat indices of a scattered part (one with `pos`: _as_parts sets both)."""
    if part.hf is None:
        raise ValueError(f"part of {part.param} has positions but no HF indices")
    return part.hf


def served_values(place: Placement, params: dict[str, torch.nn.Parameter]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(HF flat indices, values) of the elements this rank holds, each index once, sorted."""
    blocks = sorted(place.parts, key=lambda p: p.lo)
    if all(p.pos is None for p in blocks) and all(a.hi <= b.lo for a, b in zip(blocks, blocks[1:])):
        # disjoint blocks (every family's placement at TP 1): in order already, no sort (the sort
        # was most of a checked delta sync's time on the server)
        flats = [params[p.param].data.reshape(-1) for p in blocks]
        if not blocks:
            return torch.empty(0, dtype=torch.int64), torch.empty(0)
        idx = torch.cat([torch.arange(p.lo, p.hi, device=f.device) for p, f in zip(blocks, flats)])
        return idx, torch.cat([f[p.offset + p.lo:p.offset + p.hi] for p, f in zip(blocks, flats)])
    idx_parts: list[torch.Tensor] = []
    val_parts: list[torch.Tensor] = []
    for part in place.parts:
        flat = params[part.param].data.reshape(-1)
        if part.pos is None:
            idx_parts.append(torch.arange(part.lo, part.hi, device=flat.device))
            val_parts.append(flat[part.offset + part.lo:part.offset + part.hi])
        else:
            idx_parts.append(_hf_of(part).to(flat.device))
            val_parts.append(flat[part.pos.to(flat.device)])
    if not idx_parts:
        return torch.empty(0, dtype=torch.int64), torch.empty(0)
    idx, vals = torch.cat(idx_parts), torch.cat(val_parts)
    order = torch.argsort(idx)
    idx, vals = idx[order], vals[order]
    keep = torch.ones_like(idx, dtype=torch.bool)
    keep[1:] = idx[1:] != idx[:-1]
    return idx[keep], vals[keep]


@torch.no_grad()
def apply_sparse(place: Placement, params: dict[str, torch.nn.Parameter], idx: torch.Tensor,
                 vals: torch.Tensor) -> None:
    """Write vals at HF flat indices idx into every server element that holds them."""
    for part in place.parts:
        flat = params[part.param].data.view(-1)
        i, v = idx.to(device=flat.device, dtype=torch.int64), vals.to(device=flat.device, dtype=flat.dtype)
        # index_copy_: the indices are unique, and on CPU it is the faster of the two (0.03 ms
        # against 0.07 ms for `flat[i] = v`, 10k of 16M bf16 elements)
        if part.pos is None:
            if part.lo == 0 and part.hi == place.numel:  # the whole tensor in one block
                flat.index_copy_(0, part.offset + i, v)
            else:
                ok = (i >= part.lo) & (i < part.hi)
                flat.index_copy_(0, part.offset + i[ok], v[ok])
            continue
        lut = torch.full((place.numel,), -1, dtype=torch.int64, device=flat.device)
        lut[_hf_of(part).to(flat.device)] = part.pos.to(flat.device)
        where = lut[i]
        ok = where >= 0
        flat.index_copy_(0, where[ok], v[ok])
