"""Rotary position embeddings: HF `rope_theta` / `partial_rotary_factor` / `rope_scaling` ->
megatron GPTModel kwargs and TransformerConfig fields (the `Rope` feature).

    rope = rope_mapping(hf, "qwen3", head_dim=128, partial_rotary=False)
    rope.gpt_model_kwargs()   # position_embedding_type, rotary_percent, rotary_base
    rope.config_fields        # softmax_scale, yarn_* (YaRN only; layers.YarnTransformerConfig holds them)

Plain RoPE and YaRN (`rope_type: "yarn"`, e.g. Qwen3 with 4x context) are mapped; every other
rope type (llama3, linear, dynamic, longrope, ...) raises HFConfigError naming it.

YaRN as transformers computes it (modeling_rope_utils.py, _compute_yarn_parameters): each inverse
frequency blended between its interpolated (divided by `factor`) and its original value by a ramp
over the dimensions, set by beta_fast / beta_slow on the original context length; cos / sin both
multiplied by an `attention_factor` (given, or the mscale / mscale_all_dim ratio, or
0.1 ln(factor) + 1).
megatron-core's YarnRotaryEmbedding computes the same frequencies (yarn_rotary_pos_embedding.py,
get_emb), but what happens to the attention factor depends on the version: 0.16.1's GPTModel drops
it (_preprocess: `rotary_pos_emb, _ = self.rotary_pos_emb(...)`), 0.19's Attention multiplies
cos / sin by it when the config has yarn_* fields (Attention.__init__). So megatron's own factor is
pinned to 1 (yarn_mscale = yarn_mscale_all_dim = 1: the ratio is 1 in both versions) and the
factor enters as the softmax scale instead: q and k each scaled by a (full-width rotary) scale
q.k by a^2, i.e. softmax_scale = a^2 / sqrt(head_dim). With partial rotary that identity fails
(only the rotary part is scaled) and megatron's YaRN frequencies use the full kv_channels, so
YaRN with partial_rotary_factor < 1 is refused. tests/model_specs/test_rope_yarn.py checks both versions' log-probs
against transformers beyond the original context.

Multi-latent attention (DeepSeek-V3, `mla_rope_fields`) rotates only a qk_rope_head_dim slice of
each head, so the factor cannot move into the softmax scale there; MLA has its own YaRN instead
(multi_latent_attention.py: MLATransformerConfig's rotary_scaling_factor, mscale, mscale_all_dim),
and it computes what transformers' DeepseekV3 does: cos / sin times get_mscale(factor, mscale) /
get_mscale(factor, mscale_all_dim) (yarn_rotary_pos_embedding.py, _yarn_get_concentration_factor;
MLA applies it in apply_rotary_pos_emb), and a softmax scale of get_mscale(factor,
mscale_all_dim)^2 / sqrt(q_head_dim) (MultiLatentAttention.__init__; transformers:
yarn_apply_mscale, where an absent mscale_all_dim is 0, and get_mscale(f, 0) = 1). Only the
cos / sin factor is spelled differently: transformers takes `attention_factor` when given and the
mscale ratio only when both are set (else 0.1 ln f + 1); megatron's mscale is solved so that its
ratio is that factor.

Torch-free: the planner validates a model's RoPE (model_specs/shape.py) without megatron-core.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from model_specs.features import Draft, Feature
from model_specs.hf.config import HFConfigError


@dataclass(frozen=True)
class RopeMapping:
    """What an HF config's rotary settings become in megatron."""

    position_embedding_type: str
    """GPTModel position_embedding_type: "rope" or "yarn"."""
    rotary_percent: float
    """GPTModel rotary_percent: the fraction of each head's channels that are rotated (HF
    partial_rotary_factor; the rotated channels are the first ones, as in HF's apply_rotary_pos_emb)."""
    rotary_base: float
    """HF rope_theta."""
    config_fields: dict[str, Any] = field(default_factory=dict)
    """TransformerConfig fields (softmax_scale, yarn_*); yarn_* need layers.YarnTransformerConfig."""

    def gpt_model_kwargs(self) -> dict[str, Any]:
        return dict(position_embedding_type=self.position_embedding_type,
                    rotary_percent=self.rotary_percent, rotary_base=self.rotary_base)


@dataclass(frozen=True)
class Rope(Feature):
    """RoPE or YaRN on GPTModel's rotary embedding, over a head's first `partial_rotary_factor`
    of channels where `partial` (the family's HF class honours that field: GLM-4.5, Qwen3-Next;
    elsewhere a factor other than 1 is refused). Needs the head width (attention.GQA's)."""

    partial: bool = False

    def fields(self, hf: Mapping[str, Any], draft: Draft) -> None:
        rope = rope_mapping(hf, draft.family, draft.config["kv_channels"], self.partial)
        draft.gpt_model.update(rope.gpt_model_kwargs())
        draft.config.update(rope.config_fields)

    def config_class(self, draft: Draft) -> type | None:
        if draft.gpt_model["position_embedding_type"] != "yarn":
            return None
        from model_specs.features.rope.layers import YarnTransformerConfig
        return YarnTransformerConfig


def rope_mapping(hf: Mapping[str, Any], family: str, head_dim: int,
                 partial_rotary: bool) -> RopeMapping:
    """The megatron side of an HF config's RoPE. partial_rotary: the family's HF class honours
    `partial_rotary_factor` (GLM-4.5); elsewhere a factor other than 1 is an error."""
    base = float(hf.get("rope_theta", 10000.0))
    partial = float(hf.get("partial_rotary_factor") or 1.0)
    if not partial_rotary and partial != 1.0:
        raise HFConfigError(f"{family}: partial_rotary_factor={partial}, but the {family} model "
                            "rotates every channel of a head (expected 1.0 or no field)")
    if not 0.0 < partial <= 1.0 or int(head_dim * partial) % 2:
        raise HFConfigError(f"{family}: partial_rotary_factor={partial} gives "
                            f"{head_dim * partial} rotary channels of head_dim {head_dim}; expected "
                            "an even number in (0, head_dim]")
    scaling = hf.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", "default") if isinstance(scaling, Mapping) else scaling
    if rope_type in (None, "default"):
        return RopeMapping("rope", partial, base)
    if rope_type != "yarn":
        raise HFConfigError(f"{family}: rope_scaling rope_type={rope_type!r} is not supported "
                            f"(supported: default, yarn); rope_scaling={dict(scaling)}")
    if partial != 1.0:
        raise HFConfigError(f"{family}: YaRN with partial_rotary_factor={partial} is not supported: "
                            "megatron-core's YarnRotaryEmbedding computes its frequencies over the "
                            "full kv_channels (YarnRotaryEmbedding.__init__)")
    return RopeMapping("yarn", 1.0, base, _yarn_fields(hf, scaling, family, head_dim, base))


def yarn_attention_factor(factor: float, attention_factor: float | None, mscale: float | None,
                          mscale_all_dim: float | None) -> float:
    """transformers' YaRN attention factor (modeling_rope_utils.py, _compute_yarn_parameters):
    the given one, else the mscale ratio when both mscales are set (non-zero), else
    0.1 ln(factor) + 1 (1 for factor <= 1)."""
    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is not None:
        return float(attention_factor)
    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def _yarn_fields(hf: Mapping[str, Any], scaling: Mapping[str, Any], family: str, head_dim: int,
                 base: float) -> dict[str, Any]:
    # transformers (standardize_rope_params): a top-level original_max_position_embeddings wins,
    # then rope_scaling's, then max_position_embeddings
    original = hf.get("original_max_position_embeddings") or \
        scaling.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
    if not original:
        raise HFConfigError(f"{family}: YaRN needs original_max_position_embeddings or "
                            f"max_position_embeddings (rope_scaling={dict(scaling)})")
    factor = scaling.get("factor")
    if factor is None:  # transformers 5 refuses it too (modeling_rope_utils.py, "required keys")
        raise HFConfigError(f"{family}: YaRN rope_scaling lacks 'factor' "
                            f"(rope_scaling={dict(scaling)})")
    if float(factor) < 1.0:
        raise HFConfigError(f"{family}: YaRN factor={factor}, expected >= 1")
    factor = float(factor)
    attention = yarn_attention_factor(factor, scaling.get("attention_factor"), scaling.get("mscale"),
                                      scaling.get("mscale_all_dim"))
    if base <= 1.0:
        raise HFConfigError(f"{family}: rope_theta={base}, expected > 1")
    return dict(
        yarn_rotary_scaling_factor=factor,
        yarn_original_max_position_embeddings=int(original),
        # transformers: `beta_fast or 32`, `beta_slow or 1` (a 0 means the default there too)
        yarn_beta_fast=float(scaling.get("beta_fast") or 32.0),
        yarn_beta_slow=float(scaling.get("beta_slow") or 1.0),
        yarn_mscale=1.0,
        yarn_mscale_all_dim=1.0,
        yarn_correction_range_round_to_int=bool(scaling.get("truncate", True)),
        softmax_scale=attention * attention / math.sqrt(head_dim),
    )


def mla_rope_fields(hf: Mapping[str, Any], family: str, rope_dim: int) -> dict[str, Any]:
    """MLATransformerConfig's rope fields (rope_type, rotary_*, YaRN's) for an HF config whose
    attention rotates `rope_dim` (qk_rope_head_dim) channels of each head (module docstring)."""
    base = float(hf.get("rope_theta", 10000.0))
    partial = float(hf.get("partial_rotary_factor") or 1.0)
    if partial != 1.0:
        raise HFConfigError(f"{family}: partial_rotary_factor={partial}, but multi-latent attention "
                            "rotates its whole qk_rope_head_dim slice (expected 1.0 or no field)")
    if rope_dim <= 0 or rope_dim % 2:
        raise HFConfigError(f"{family}: qk_rope_head_dim={rope_dim}, expected an even number > 0")
    plain = dict(rope_type="rope", rotary_base=base, rotary_percent=1.0, rotary_scaling_factor=1.0,
                 mscale=1.0, mscale_all_dim=0.0)
    scaling = hf.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", "default") if isinstance(scaling, Mapping) else scaling
    if rope_type in (None, "default"):
        return plain
    if rope_type != "yarn":
        raise HFConfigError(f"{family}: rope_scaling rope_type={rope_type!r} is not supported "
                            f"(supported: default, yarn); rope_scaling={dict(scaling)}")
    if not scaling.get("truncate", True):
        raise HFConfigError(f"{family}: YaRN with truncate=false is not supported: megatron-core's "
                            "multi-latent attention always rounds the ramp's bounds "
                            "(multi_latent_attention.py builds YarnRotaryEmbedding without "
                            "correction_range_round_to_int)")
    fields = _yarn_fields(hf, scaling, family, rope_dim, base)
    factor = fields["yarn_rotary_scaling_factor"]
    all_dim = float(scaling.get("mscale_all_dim") or 0.0)
    mscale, given = scaling.get("mscale"), scaling.get("attention_factor")
    if factor <= 1.0:
        megatron_mscale = 1.0  # every factor is 1 (get_mscale(f <= 1, .) = 1)
    elif given is None and mscale and all_dim:
        megatron_mscale = float(mscale)  # transformers' ratio is megatron's, term for term
    else:
        attention = yarn_attention_factor(factor, given, mscale, all_dim)
        denominator = 0.1 * all_dim * math.log(factor) + 1.0
        megatron_mscale = (attention * denominator - 1.0) / (0.1 * math.log(factor))
    return dict(plain, rope_type="yarn", rotary_scaling_factor=factor,
                original_max_position_embeddings=fields["yarn_original_max_position_embeddings"],
                beta_fast=fields["yarn_beta_fast"], beta_slow=fields["yarn_beta_slow"],
                mscale=megatron_mscale, mscale_all_dim=all_dim)
