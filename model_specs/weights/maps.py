"""HF <-> megatron-core weight maps: one model's parameters and the conversions of their tensors.

Used by the checkpoint converters (tools/convert_*.py) and by the weight sync into SGLang
(gspo_megatron/sync/): both see the model as a list of `ParamMapping`s, one per megatron parameter
under its *global* name (global layer index, global expert index; what the parameter is called in a
TP1/PP1/EP1 model), each with its HF tensors and how they are fused.

    wmap = weight_map_for(hf_config)
    for m in wmap.mappings():                     # every megatron parameter, in HF order
        full = wmap.to_megatron(m, [hf[n] for n in m.hf])
        hf_tensors = wmap.to_hf(m, full)          # the inverse, bit-exact

The rules come from the model's family: every feature adds its own (rules.py; the decoder's
embedding, norms, output projection, dense MLP and head: features/decoder.py). The fused kinds
(checked against megatron-core 0.16.1):
- `linear_qkv` (with or without an output gate) and a Gated DeltaNet's `in_proj`: layouts.py.
- `linear_fc1` of a gated MLP (mlp.py, glu): rows [gate; up]. A TP rank holds [gate_r; up_r]
  (apply_swiglu_sharded_factory), so merging TP shards is NOT a plain concatenation.
- Stacked experts (gpt-oss): one HF tensor holds every expert of a layer along dim 0, so each
  expert's megatron parameter is one slice of it (`ParamMapping.stacked`): `to_megatron` takes
  the whole HF tensor and cuts the expert's slice, `to_hf` gives the slice, and `hf_tensors`
  stacks a layer's slices back into the HF tensor (the converters and the sync hand it every
  expert of that tensor at once: `together_key`). `gate_up_proj` is [E, h, 2 x ffn] with gate and
  up interleaved along the last dim (transformers' GptOssExperts._apply_gate: [..., ::2],
  [..., 1::2]) and transposed against megatron's fc1; `down_proj` is [E, ffn, h], fc2 transposed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch

from model_specs import family_for
from model_specs.hf.config import normalize_hf_config
from model_specs.weights.layouts import (WeightMapError, fuse_gdn_in_proj, fuse_qkv,
                                         split_gdn_in_proj, split_qkv)
from model_specs.weights.rules import (GATE_UP, GDN_IN_PROJ, QKV, STACKED_GATE_UP,
                                       STACKED_GATE_UP_BIAS, STACKED_KINDS, STACKED_T, WeightRule,
                                       ordered)

# A live TE-spec model names some parameters differently from the local spec (whose names the map
# uses): TE fuses the norms into the following linear layer, and its grouped-GEMM experts hold
# one `weight{e}` per expert. canonical_megatron_name() maps either to the map's name. (Checkpoint
# keys agree between the specs: model_specs.norms.te_checkpoint_keys.)
_TE_NAMES = ((re.compile(r"\.self_attention\.(linear_qkv|in_proj)\.layer_norm_weight$"),
              ".input_layernorm.weight"),
             (re.compile(r"\.mlp\.linear_fc1\.layer_norm_weight$"), ".pre_mlp_layernorm.weight"),
             (re.compile(r"\.self_attention\.linear_(q|kv)_up_proj\.layer_norm_weight$"),
              r".self_attention.\1_layernorm.weight"),
             (re.compile(r"\.mlp\.experts\.linear_fc([12])\.(weight|bias)(\d+)$"),
              r".mlp.experts.local_experts.\3.linear_fc\1.\2"))


def canonical_megatron_name(name: str) -> str:
    """The weight-map name of a live parameter, whichever layer spec (local or TE, sequential or
    grouped experts) built it."""
    for pattern, local in _TE_NAMES:
        name = pattern.sub(local, name)
    return name

# HF tensors that carry no weights (recomputed buffers some exporters include).
# Qwen3-Next's checkpoints hold a multi-token-prediction layer under `mtp.` (transformers ignores it).
IGNORED_HF = re.compile(r".*rotary_emb\.inv_freq$|^mtp\.")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class ParamMapping:
    """One megatron parameter (global name) and the HF tensors it is made of."""

    megatron: str
    hf: tuple[str, ...]
    kind: str
    tp_dim: int | None
    layer: int | None = None
    expert: int | None = None
    layout: tuple[int, ...] = ()
    """The dimensions its kind converts by (rules.WeightRule.layout)."""

    @property
    def is_expert(self) -> bool:
        return self.expert is not None

    @property
    def stacked(self) -> bool:
        """The HF tensor stacks every expert of the layer; this parameter is slice `expert`."""
        return self.kind in STACKED_KINDS


@dataclass(frozen=True)
class WeightMap:
    """The map for one model: its rules, placed on its layers and experts."""

    family: str
    num_layers: int
    num_experts: int
    rules: tuple[WeightRule, ...]
    """In HF order (rules.ordered)."""
    extra_hf_layers: int = 0
    """Layers after the model's in HF checkpoints that the model does not use (GLM-4.5's
    multi-token-prediction layers, `num_nextn_predict_layers`)."""

    def mappings(self) -> Iterator[ParamMapping]:
        """Every megatron parameter of the model, in HF order (embedding, layers, head)."""
        model = [r for r in self.rules if r.scope == "model"]
        yield from (_mapping(r) for r in model if r.slot == "embedding")
        for layer in range(self.num_layers):
            for r in self.rules:
                if r.scope == "model" or (r.layers is not None and layer not in r.layers):
                    continue
                if r.scope == "layer":
                    yield _mapping(r, layer=layer)
                else:
                    yield from (_mapping(r, layer=layer, expert=e) for e in range(self.num_experts))
        yield from (_mapping(r) for r in model if r.slot != "embedding")

    def by_megatron_name(self) -> dict[str, ParamMapping]:
        return {m.megatron: m for m in self.mappings()}

    def hf_names(self) -> list[str]:
        return [n for m in self.mappings() for n in m.hf]

    def ignores_hf(self, name: str) -> bool:
        """An HF tensor that carries nothing of this model (a recomputed buffer, an MTP layer)."""
        if IGNORED_HF.match(name):
            return True
        m = _HF_LAYER.match(name)
        return m is not None and self.num_layers <= int(m.group(1)) < self.num_layers + self.extra_hf_layers

    # ---- conversions of full (TP-merged) tensors ----
    def to_megatron(self, m: ParamMapping, hf_tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The megatron tensor of `m` from its whole HF tensors (a stacked one: all experts)."""
        if len(hf_tensors) != len(m.hf):
            raise WeightMapError(f"{m.megatron}: expected {len(m.hf)} HF tensors {m.hf}, "
                                 f"got {len(hf_tensors)}")
        if m.stacked:
            stack = hf_tensors[0]
            if stack.dim() < 2 or stack.shape[0] != self.num_experts:
                raise WeightMapError(f"{m.hf[0]} has shape {tuple(stack.shape)}, expected "
                                     f"{self.num_experts} experts along dim 0")
            part = stack[m.expert]
            if m.kind in (STACKED_GATE_UP, STACKED_GATE_UP_BIAS):      # [.., 2f] interleaved
                part = part.transpose(0, 1) if m.kind == STACKED_GATE_UP else part  # [2f, ..]
                return torch.cat([part[0::2], part[1::2]], dim=0).contiguous()  # [gate; up]
            return part.transpose(0, 1).contiguous() if m.kind == STACKED_T else part.clone()
        if m.kind == QKV:
            heads, groups, head_dim, gated = m.layout
            q, k, v = hf_tensors
            return fuse_qkv(q, k, v, heads, groups, head_dim, gated=bool(gated))
        if m.kind == GDN_IN_PROJ:
            qkvz, ba = hf_tensors
            return fuse_gdn_in_proj(qkvz, ba, *m.layout)
        if m.kind == GATE_UP:
            return torch.cat(list(hf_tensors), dim=0)
        return hf_tensors[0]

    def to_hf(self, m: ParamMapping, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The HF tensors (contiguous) of one full megatron tensor, in the order of `m.hf`; for a
        stacked one the expert's slice (`hf_tensors` stacks them)."""
        if m.kind in (STACKED_GATE_UP, STACKED_GATE_UP_BIAS):
            gate, up = torch.chunk(tensor, 2, dim=0)                        # [f, ..] each
            inter = torch.stack([gate, up], dim=1).reshape(tensor.shape)   # [2f, ..] interleaved
            return [inter.transpose(0, 1).contiguous() if m.kind == STACKED_GATE_UP else inter]
        if m.kind == STACKED_T:
            return [tensor.transpose(0, 1).contiguous()]
        if m.kind == QKV:
            heads, groups, head_dim, gated = m.layout
            return split_qkv(tensor, heads, groups, head_dim, gated=bool(gated))
        if m.kind == GDN_IN_PROJ:
            return split_gdn_in_proj(tensor, *m.layout)
        if m.kind == GATE_UP:
            return [t.contiguous() for t in torch.chunk(tensor, 2, dim=0)]
        return [tensor.contiguous()]

    def hf_shapes(self, m: ParamMapping, megatron_shape: Sequence[int]) -> list[tuple[int, ...]]:
        """The shapes of `m`'s whole HF tensors (a stacked one with its experts' dim)."""
        meta = torch.empty(tuple(megatron_shape), device="meta")
        experts = (self.num_experts,) if m.stacked else ()
        return [experts + tuple(t.shape) for t in self.to_hf(m, meta)]

    def hf_tensors(self, pairs: Sequence[tuple[ParamMapping, torch.Tensor]]
                   ) -> list[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of full megatron tensors, a stacked HF tensor assembled from its
        experts' slices; every expert of a stacked tensor must be among `pairs` (together_key)."""
        out: list[tuple[str, torch.Tensor]] = []
        slices: dict[str, dict[int, torch.Tensor]] = {}
        for m, tensor in pairs:
            for name, t in zip(m.hf, self.to_hf(m, tensor)):
                if not m.stacked:
                    out.append((name, t))
                    continue
                if name not in slices:
                    slices[name] = {}
                    out.append((name, None))  # type: ignore[arg-type]  # filled in below
                if m.expert is None:
                    raise WeightMapError(f"{name}: a stacked tensor's mapping names no expert")
                slices[name][m.expert] = t
        for i, (name, t) in enumerate(out):
            if t is None:
                got = slices[name]
                if sorted(got) != list(range(self.num_experts)):
                    raise WeightMapError(f"{name} stacks {self.num_experts} experts, got experts "
                                         f"{sorted(got)} only: the caller must pass them together")
                out[i] = (name, torch.stack([got[e] for e in range(self.num_experts)]))
        return out

    @staticmethod
    def together_key(m: ParamMapping) -> str | None:
        """The HF tensor whose experts' parameters must be converted together (stacked), or None."""
        return m.hf[0] if m.stacked else None


def _mapping(r: WeightRule, layer: int | None = None, expert: int | None = None) -> ParamMapping:
    fmt = dict(layer=layer, expert=expert)
    return ParamMapping(r.megatron.format(**fmt), tuple(h.format(**fmt) for h in r.hf), r.kind,
                        r.tp_dim, layer, expert, r.layout)


def weight_map_for(hf_config: Mapping[str, Any]) -> WeightMap:
    """The weight map of an HF model (config dict): its family's features' rules; raises
    HFConfigError for unknown families."""
    hf = normalize_hf_config(hf_config)
    family = family_for(hf)
    rules: list[WeightRule] = []
    for feature in family.all_features:
        rules = feature.weight_rules(hf, rules)
    experts = any(r.scope == "expert" for r in rules)
    return WeightMap(family=family.name, num_layers=int(hf["num_hidden_layers"]),
                     num_experts=int(hf.get("num_experts") or 0) if experts else 0,
                     rules=tuple(ordered(rules)),
                     extra_hf_layers=int(hf.get("num_nextn_predict_layers") or 0))
