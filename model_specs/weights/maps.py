"""HF <-> megatron-core weight maps: one declarative table for every decoder family.

Used by the checkpoint converters (tools/convert_*.py) and by the weight sync into SGLang
(gspo_megatron/sync/): both see the model as a list of `ParamMapping`s, one per megatron parameter
under its *global* name (global layer index, global expert index; what the parameter is called in a
TP1/PP1/EP1 model), each with its HF tensors and how they are fused.

    wmap = weight_map_for(hf_config)
    for m in wmap.mappings():                     # every megatron parameter, in HF order
        full = wmap.to_megatron(m, [hf[n] for n in m.hf])
        hf_tensors = wmap.to_hf(m, full)          # the inverse, bit-exact

Fused layouts (checked against megatron-core 0.16.1):
- `linear_qkv` (with or without an output gate) and a Gated DeltaNet's `in_proj`: fused_layouts.py.
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
from model_specs.weights.layouts import (WeightMapError, fuse_gdn_in_proj, fuse_qkv,
                                         split_gdn_in_proj, split_qkv)
from model_specs.gdn_fields import layer_types
from model_specs.hf.config import moe_layer_pattern, normalize_hf_config
from model_specs.traits import attention_options

# The parameter kinds: how a megatron tensor relates to its HF tensors.
COPY, QKV, GATE_UP, GDN_IN_PROJ = "copy", "qkv", "gate_up", "gdn_in_proj"
# One expert's slice of a stacked HF tensor (module docstring): gate_up_proj [E, h, 2f]
# interleaved, its bias [E, 2f] interleaved, down_proj [E, f, h] (transposed), its bias [E, h].
STACKED_GATE_UP, STACKED_GATE_UP_BIAS, STACKED_T, STACKED = (
    "stacked_gate_up", "stacked_gate_up_bias", "stacked_t", "stacked")
STACKED_KINDS = (STACKED_GATE_UP, STACKED_GATE_UP_BIAS, STACKED_T, STACKED)


@dataclass(frozen=True)
class WeightRule:
    """One line of the map: a megatron parameter name template <-> HF name templates.

    Templates use `{layer}` (global layer index) and `{expert}` (global expert index)."""

    megatron: str
    hf: tuple[str, ...]
    kind: str = COPY
    tp_dim: int | None = None
    """Dimension split across tensor-parallel ranks (column-parallel / vocab: 0, row-parallel: 1);
    None = replicated. For experts the split is across the expert-tensor-parallel group."""
    scope: str = "model"
    """model: once; layer: every layer; dense: dense-MLP layers; moe: MoE layers; expert: every
    expert of every MoE layer (split across expert-parallel ranks); linear: Qwen3-Next's Gated
    DeltaNet layers, which have these in place of every `self_attention.` rule."""
    when: str | None = None
    """A condition on the model: 'qkv' (fused q/k/v) or 'mla' + 'mla_q_lora' / 'mla_q_proj'
    (multi-latent attention with or without q's bottleneck), 'qk_norm', 'qkv_bias', 'untied',
    'expert_bias' (sigmoid router), 'shared_expert' + 'shared_expert_gate' (Qwen2-MoE's names),
    'shared_experts' (GLM-4.5's, DeepSeek-V3's), 'per_expert' / 'stacked_experts' (how HF
    stores the router and experts: traits.FamilyTraits.experts), 'linear_bias' (a bias on the
    output projection: gpt-oss), 'sinks' (attention sinks)."""


L = "decoder.layers.{layer}."
H = "model.layers.{layer}."
RULES: tuple[WeightRule, ...] = (
    WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), tp_dim=0),
    WeightRule(L + "input_layernorm.weight", (H + "input_layernorm.weight",), scope="layer"),
    WeightRule(L + "self_attention.linear_qkv.weight",
               (H + "self_attn.q_proj.weight", H + "self_attn.k_proj.weight",
                H + "self_attn.v_proj.weight"), QKV, tp_dim=0, scope="layer", when="qkv"),
    # Multi-latent attention (model_specs/mla.py has the table and the layouts): q through a
    # low-rank bottleneck with an RMSNorm, or one projection when q_lora_rank is null; k and v
    # from one latent with an RMSNorm. The down-projections are whole on every TP rank in both
    # specs (model_specs/mla.py); the live parameter says which (actor/weights.py).
    WeightRule(L + "self_attention.linear_q_proj.weight", (H + "self_attn.q_proj.weight",),
               tp_dim=0, scope="layer", when="mla_q_proj"),
    WeightRule(L + "self_attention.linear_q_down_proj.weight", (H + "self_attn.q_a_proj.weight",),
               tp_dim=0, scope="layer", when="mla_q_lora"),
    WeightRule(L + "self_attention.q_layernorm.weight", (H + "self_attn.q_a_layernorm.weight",),
               scope="layer", when="mla_q_lora"),
    WeightRule(L + "self_attention.linear_q_up_proj.weight", (H + "self_attn.q_b_proj.weight",),
               tp_dim=0, scope="layer", when="mla_q_lora"),
    WeightRule(L + "self_attention.linear_kv_down_proj.weight",
               (H + "self_attn.kv_a_proj_with_mqa.weight",), tp_dim=0, scope="layer", when="mla"),
    WeightRule(L + "self_attention.kv_layernorm.weight", (H + "self_attn.kv_a_layernorm.weight",),
               scope="layer", when="mla"),
    WeightRule(L + "self_attention.linear_kv_up_proj.weight", (H + "self_attn.kv_b_proj.weight",),
               tp_dim=0, scope="layer", when="mla"),
    WeightRule(L + "self_attention.linear_qkv.bias",
               (H + "self_attn.q_proj.bias", H + "self_attn.k_proj.bias",
                H + "self_attn.v_proj.bias"), QKV, tp_dim=0, scope="layer", when="qkv_bias"),
    WeightRule(L + "self_attention.q_layernorm.weight", (H + "self_attn.q_norm.weight",),
               scope="layer", when="qk_norm"),
    WeightRule(L + "self_attention.k_layernorm.weight", (H + "self_attn.k_norm.weight",),
               scope="layer", when="qk_norm"),
    WeightRule(L + "self_attention.linear_proj.weight", (H + "self_attn.o_proj.weight",),
               tp_dim=1, scope="layer"),
    WeightRule(L + "self_attention.linear_proj.bias", (H + "self_attn.o_proj.bias",),
               scope="layer", when="linear_bias"),
    # megatron's learnable softmax offset is HF's sinks: one logit per head (model_specs/sinks.py)
    WeightRule(L + "self_attention.core_attention.softmax_offset", (H + "self_attn.sinks",),
               tp_dim=0, scope="layer", when="sinks"),
    # Qwen3-Next's Gated DeltaNet (model_specs/gdn.py; the in_proj layout: fused_layouts.py)
    WeightRule(L + "self_attention.in_proj.weight",
               (H + "linear_attn.in_proj_qkvz.weight", H + "linear_attn.in_proj_ba.weight"),
               GDN_IN_PROJ, tp_dim=0, scope="linear"),
    WeightRule(L + "self_attention.conv1d.weight", (H + "linear_attn.conv1d.weight",), tp_dim=0,
               scope="linear"),
    WeightRule(L + "self_attention.A_log", (H + "linear_attn.A_log",), tp_dim=0, scope="linear"),
    WeightRule(L + "self_attention.dt_bias", (H + "linear_attn.dt_bias",), tp_dim=0, scope="linear"),
    WeightRule(L + "self_attention.out_norm.weight", (H + "linear_attn.norm.weight",), scope="linear"),
    WeightRule(L + "self_attention.out_proj.weight", (H + "linear_attn.out_proj.weight",), tp_dim=1,
               scope="linear"),
    WeightRule(L + "pre_mlp_layernorm.weight", (H + "post_attention_layernorm.weight",),
               scope="layer"),
    WeightRule(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"),
               GATE_UP, tp_dim=0, scope="dense"),
    WeightRule(L + "mlp.linear_fc2.weight", (H + "mlp.down_proj.weight",), tp_dim=1, scope="dense"),
    WeightRule(L + "mlp.router.weight", (H + "mlp.gate.weight",), scope="moe", when="per_expert"),
    # megatron keeps the expert bias as a buffer; model_specs.moe.ExpertBiasRouter makes it a
    # frozen parameter under the same name (fp32, as HF keeps e_score_correction_bias).
    WeightRule(L + "mlp.router.expert_bias", (H + "mlp.gate.e_score_correction_bias",),
               scope="moe", when="expert_bias"),
    WeightRule(L + "mlp.experts.local_experts.{expert}.linear_fc1.weight",
               (H + "mlp.experts.{expert}.gate_proj.weight", H + "mlp.experts.{expert}.up_proj.weight"),
               GATE_UP, tp_dim=0, scope="expert", when="per_expert"),
    WeightRule(L + "mlp.experts.local_experts.{expert}.linear_fc2.weight",
               (H + "mlp.experts.{expert}.down_proj.weight",), tp_dim=1, scope="expert",
               when="per_expert"),
    # gpt-oss: the router (with a bias) and the experts stacked per layer (module docstring)
    WeightRule(L + "mlp.router.weight", (H + "mlp.router.weight",), scope="moe",
               when="stacked_experts"),
    WeightRule(L + "mlp.router.bias", (H + "mlp.router.bias",), scope="moe", when="stacked_experts"),
    WeightRule(L + "mlp.experts.local_experts.{expert}.linear_fc1.weight",
               (H + "mlp.experts.gate_up_proj",), STACKED_GATE_UP, tp_dim=0, scope="expert",
               when="stacked_experts"),
    WeightRule(L + "mlp.experts.local_experts.{expert}.linear_fc1.bias",
               (H + "mlp.experts.gate_up_proj_bias",), STACKED_GATE_UP_BIAS, tp_dim=0,
               scope="expert", when="stacked_experts"),
    WeightRule(L + "mlp.experts.local_experts.{expert}.linear_fc2.weight",
               (H + "mlp.experts.down_proj",), STACKED_T, tp_dim=1, scope="expert",
               when="stacked_experts"),
    WeightRule(L + "mlp.experts.local_experts.{expert}.linear_fc2.bias",
               (H + "mlp.experts.down_proj_bias",), STACKED, scope="expert",
               when="stacked_experts"),
    # Shared experts: an MLP over the (expert-independent) TP group, in every MoE layer.
    WeightRule(L + "mlp.shared_experts.linear_fc1.weight",
               (H + "mlp.shared_expert.gate_proj.weight", H + "mlp.shared_expert.up_proj.weight"),
               GATE_UP, tp_dim=0, scope="moe", when="shared_expert"),
    WeightRule(L + "mlp.shared_experts.linear_fc2.weight", (H + "mlp.shared_expert.down_proj.weight",),
               tp_dim=1, scope="moe", when="shared_expert"),
    WeightRule(L + "mlp.shared_experts.gate_weight", (H + "mlp.shared_expert_gate.weight",),
               scope="moe", when="shared_expert_gate"),
    WeightRule(L + "mlp.shared_experts.linear_fc1.weight",
               (H + "mlp.shared_experts.gate_proj.weight", H + "mlp.shared_experts.up_proj.weight"),
               GATE_UP, tp_dim=0, scope="moe", when="shared_experts"),
    WeightRule(L + "mlp.shared_experts.linear_fc2.weight",
               (H + "mlp.shared_experts.down_proj.weight",), tp_dim=1, scope="moe",
               when="shared_experts"),
    WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    WeightRule("output_layer.weight", ("lm_head.weight",), tp_dim=0, when="untied"),
)

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

    @property
    def is_expert(self) -> bool:
        return self.expert is not None

    @property
    def stacked(self) -> bool:
        """The HF tensor stacks every expert of the layer; this parameter is slice `expert`."""
        return self.kind in STACKED_KINDS


@dataclass(frozen=True)
class WeightMap:
    """The map for one model: its dimensions decide the fused layouts and which rules apply."""

    family: str
    num_layers: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    moe_layers: tuple[bool, ...]
    num_experts: int
    flags: frozenset[str]
    extra_hf_layers: int = 0
    """Layers after the model's in HF checkpoints that the model does not use (GLM-4.5's
    multi-token-prediction layers, `num_nextn_predict_layers`)."""
    linear_layers: tuple[bool, ...] = ()
    """Qwen3-Next: the Gated DeltaNet layers (the others full attention, with an output gate)."""
    gdn_dims: tuple[int, int, int, int] = (0, 0, 0, 0)
    """Qwen3-Next: the DeltaNet's key heads, key head dim, value heads, value head dim."""

    def mappings(self) -> Iterator[ParamMapping]:
        """Every megatron parameter of the model, in HF order (embedding, layers, head)."""
        rules = [r for r in RULES if r.when is None or r.when in self.flags]
        for r in (r for r in rules if r.scope == "model" and r.megatron.startswith("embedding")):
            yield _mapping(r)
        for layer in range(self.num_layers):
            moe = self.moe_layers[layer]
            linear = bool(self.linear_layers) and self.linear_layers[layer]
            for r in rules:
                if linear and r.scope == "layer" and ".self_attention." in r.megatron:
                    continue  # a DeltaNet layer: its own rules (scope "linear") instead
                if (r.scope == "layer" or r.scope == ("moe" if moe else "dense")
                        or (r.scope == "linear" and linear)):
                    yield _mapping(r, layer=layer)
                elif r.scope == "expert" and moe:
                    yield from (_mapping(r, layer=layer, expert=e) for e in range(self.num_experts))
        for r in (r for r in rules if r.scope == "model" and not r.megatron.startswith("embedding")):
            yield _mapping(r)

    def by_megatron_name(self) -> dict[str, ParamMapping]:
        return {m.megatron: m for m in self.mappings()}

    def hf_names(self) -> list[str]:
        return [n for m in self.mappings() for n in m.hf]

    def ignores_hf(self, name: str) -> bool:
        """An HF tensor that carries nothing of this model (a recomputed buffer, an MTP layer)."""
        if IGNORED_HF.match(name):
            return True
        m = _HF_LAYER.match(name)
        return bool(m) and self.num_layers <= int(m.group(1)) < self.num_layers + self.extra_hf_layers

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
            return fuse_qkv(*hf_tensors, self.num_heads, self.num_query_groups, self.head_dim,
                            gated="attn_gate" in self.flags)
        if m.kind == GDN_IN_PROJ:
            return fuse_gdn_in_proj(*hf_tensors, *self.gdn_dims)
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
            return split_qkv(tensor, self.num_heads, self.num_query_groups, self.head_dim,
                             gated="attn_gate" in self.flags)
        if m.kind == GDN_IN_PROJ:
            return split_gdn_in_proj(tensor, *self.gdn_dims)
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
                        r.tp_dim, layer, expert)


# ---- building the map from an HF config ----
def weight_map_for(hf_config: Mapping[str, Any]) -> WeightMap:
    """The weight map of an HF model (config dict); raises HFConfigError for unknown families."""
    hf = normalize_hf_config(hf_config)
    traits = family_for(hf).traits
    layers = int(hf["num_hidden_layers"])
    heads = int(hf["num_attention_heads"])
    flags = {"mla", "mla_q_proj" if hf.get("q_lora_rank") is None else "mla_q_lora"} \
        if traits.attention == "mla" else {"qkv"}
    qk_norm, qkv_bias = attention_options(traits, hf)
    if qk_norm:
        flags.add("qk_norm")
    if qkv_bias:
        flags.add("qkv_bias")
    if not hf.get("tie_word_embeddings", False):
        flags.add("untied")
    if traits.moe and traits.router == "sigmoid":
        flags.add("expert_bias")
    if traits.moe:
        flags.add("stacked_experts" if traits.experts == "stacked" else "per_expert")
    if traits.attention == "gqa_sinks":
        flags.update(("linear_bias", "sinks"))
    if traits.moe and traits.shared_expert == "gated":
        flags.update(("shared_expert", "shared_expert_gate"))
    elif traits.moe and traits.shared_expert == "plain":
        flags.add("shared_experts")
    moe = [bool(x) for x in moe_layer_pattern(hf, layers)] if traits.moe else [False] * layers
    linear, gdn = (), (0, 0, 0, 0)
    if traits.attention == "gdn_hybrid":
        flags.add("attn_gate")
        linear = tuple(t == "linear_attention" for t in layer_types(hf, layers))
        gdn = tuple(int(hf[k]) for k in ("linear_num_key_heads", "linear_key_head_dim",
                                         "linear_num_value_heads", "linear_value_head_dim"))
    return WeightMap(
        family=traits.name, num_layers=layers, num_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        moe_layers=tuple(moe), num_experts=int(hf.get("num_experts") or 0) if traits.moe else 0,
        flags=frozenset(flags), extra_hf_layers=int(hf.get("num_nextn_predict_layers") or 0),
        linear_layers=linear, gdn_dims=gdn)  # type: ignore[arg-type]
