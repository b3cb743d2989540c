"""A model's shape from its HF config, torch-free: the TransformerConfig fields that count its
parameters and size its memory, without importing torch or megatron-core.

    shape = model_shape_for("/models/Qwen3-235B-A22B")
    shape.config.num_layers, shape.config.moe_router_topk, shape.vocab_size      # 94, 8, 151936

The planner (`gspo-megatron plan`) and param_count read a ModelShape where a ModelSpec would need
megatron-core (10 s of imports on a busy 2-core machine, most of it torch and the fusions megatron
compiles on import). `model_fields` is the one mapping of these fields, the family's features
asked in turn: build_model_spec (build.py) starts its TransformerConfig from it, and
tests/model_specs/test_published.py checks that every ShapeConfig field equals the built
TransformerConfig's for each family and published model.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from model_specs.families import Family, family_for
from model_specs.features import Draft
from model_specs.hf.config import HFConfigError, load_hf_config, model_dims, require


@dataclass(frozen=True)
class ShapeConfig:
    """The shape fields of a TransformerConfig (same names, same defaults; the multi-latent
    attention ones are MLATransformerConfig's, read only when multi_latent_attention is set)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    gated_linear_unit: bool = False
    add_qkv_bias: bool = False
    add_bias_linear: bool = True
    softmax_type: str = "vanilla"
    qk_layernorm: bool = False
    num_moe_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_layer_freq: int | list[int] = 1
    moe_router_topk: int = 2
    moe_router_enable_expert_bias: bool = False
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    multi_latent_attention: bool = False
    q_lora_rank: int | None = 512
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    experimental_attention_variant: str | None = None
    linear_attention_freq: int | list[int] | None = None
    linear_conv_kernel_dim: int | None = 4
    linear_key_head_dim: int | None = 128
    linear_value_head_dim: int | None = 128
    linear_num_key_heads: int | None = 16
    linear_num_value_heads: int | None = 32
    attention_output_gate: bool = False


SHAPE_FIELDS = tuple(f.name for f in dataclasses.fields(ShapeConfig))


@dataclass(frozen=True)
class ModelShape:
    """What a ModelSpec says of a model's size (param_count and the planner take either)."""

    family: str
    config: ShapeConfig
    vocab_size: int
    share_embeddings_and_output_weights: bool

    @property
    def is_moe(self) -> bool:
        return bool(self.config.num_moe_experts)


def model_fields(family: Family, hf: Mapping[str, Any]) -> Draft:
    """The TransformerConfig fields (and GPTModel's rope arguments) of an HF config, each of the
    family's features adding its own; a config this project cannot map is refused by the field's
    name."""
    if hf.get("model_type") not in family.model_types:
        raise HFConfigError(f"model_type {hf.get('model_type')!r} is not a {family.name} model "
                            f"(expected one of {family.model_types})")
    draft = Draft(family.name, family.all_features)
    for feature in draft.features:
        feature.fields(hf, draft)
    return draft


def model_shape_for(source: str | Path | Mapping[str, Any]) -> ModelShape:
    """The ModelShape of an HF model (dict, config.json or model directory)."""
    hf = load_hf_config(source)
    family = family_for(hf)
    fields = model_fields(family, hf).config
    return ModelShape(
        family=family.name,
        config=ShapeConfig(**{k: fields[k] for k in SHAPE_FIELDS if k in fields}),
        vocab_size=int(require(hf, "vocab_size", family.name)),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
    )


def model_dims_for(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """The dimensions a parallel layout must divide (hf_config.model_dims): num_layers,
    num_attention_heads, num_query_groups, vocab_size, num_experts (None: dense)."""
    hf = load_hf_config(source)
    family = family_for(hf)
    return model_dims(hf, family.name, family.moe)
