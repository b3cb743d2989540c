"""A model's shape from its HF config, torch-free: the TransformerConfig fields that count its
parameters and size its memory, without importing torch or megatron-core.

    shape = model_shape_for("/models/Qwen3-235B-A22B")
    shape.config.num_layers, shape.config.moe_router_topk, shape.vocab_size      # 94, 8, 151936

The planner (`gspo-megatron plan`) and param_count read a ModelShape where a ModelSpec would need
megatron-core (10 s of imports on a busy 2-core machine, most of it torch and the fusions megatron
compiles on import). `shape_fields` is the one mapping of these fields: build_model_spec
(common.py) starts its TransformerConfig from it, and tests/model_specs/test_published.py checks that
every ShapeConfig field equals the built TransformerConfig's for each family and published model.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from model_specs.gdn_fields import gdn_fields
from model_specs.gpt_oss_fields import gpt_oss_fields
from model_specs.hf.config import HFConfigError, load_hf_config, model_dims, require
from model_specs.mla_fields import mla_fields
from model_specs.moe_fields import moe_config_fields
from model_specs.rope import rope_mapping
from model_specs.traits import FamilyTraits, attention_options, traits_for


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


def shape_fields(traits: FamilyTraits, hf: Mapping[str, Any]) -> dict[str, Any]:
    """The TransformerConfig fields of an HF config's shape (MoE fields included: moe_fields.py);
    a config this project cannot map is refused by the field's name."""
    fam = traits.name
    if hf.get("model_type") not in traits.model_types:
        raise HFConfigError(f"model_type {hf.get('model_type')!r} is not a {fam} model "
                            f"(expected one of {traits.model_types})")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFConfigError(f"{fam}: hidden_act={hf['hidden_act']!r}, expected 'silu'")
    if hf.get("use_sliding_window"):
        raise HFConfigError(f"{fam}: use_sliding_window=true is not supported (sliding-window "
                            f"attention, sliding_window={hf.get('sliding_window')})")
    if hf.get("mlp_bias"):
        raise HFConfigError(f"{fam}: mlp_bias=true is not supported (megatron add_bias_linear would "
                            "also add a bias to the attention output projection)")
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method") if isinstance(
            hf["quantization_config"], Mapping) else hf["quantization_config"]
        if not (method == "mxfp4" and traits.experts == "stacked"):
            _refuse_quantization(fam, method)
    num_layers = int(require(hf, "num_hidden_layers", fam))
    hidden = int(require(hf, "hidden_size", fam))
    heads = int(require(hf, "num_attention_heads", fam))
    fields: dict[str, Any] = dict(
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_hidden_size=int(require(hf, "intermediate_size", fam)),
        num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        gated_linear_unit=True,
        add_bias_linear=False,
    )
    if traits.attention == "mla":
        fields.update(mla_fields(hf, fam, heads))  # its own rope; refuses what it cannot map
    else:
        if traits.attention == "gqa_sinks":
            fields.update(gpt_oss_fields(hf, fam, num_layers))
        elif traits.attention == "gdn_hybrid":
            fields.update(gdn_fields(hf, fam, num_layers))
        head_dim = int(hf.get("head_dim") or hidden // heads)
        rope_mapping(hf, fam, head_dim, traits.partial_rotary)  # refuses what RoPE cannot map
        qk_norm, qkv_bias = attention_options(traits, hf)
        fields.update(kv_channels=head_dim, add_qkv_bias=qkv_bias, qk_layernorm=qk_norm)
    if traits.moe:
        fields.update(moe_config_fields(hf, fam, num_layers, traits.router, traits.shared_expert,
                                        traits.expert_size_field))
    return fields


def _refuse_quantization(fam: str, method: Any) -> None:
    # gpt-oss's MXFP4 experts are the exception: the converter dequantizes them on import
    # (gspo_megatron/checkpoint/mxfp4.py), and the trainer holds bf16 / fp32 from then on
    raise HFConfigError(f"{fam}: quantization_config (quant_method={method!r}) is not supported: "
                        "the trainer holds bf16 / fp32 weights; give it a bf16 copy of the model "
                        "(for DeepSeek-V3's fp8 weights: DeepSeek's inference/fp8_cast_bf16.py)")


def model_shape_for(source: str | Path | Mapping[str, Any]) -> ModelShape:
    """The ModelShape of an HF model (dict, config.json or model directory)."""
    hf = load_hf_config(source)
    traits = traits_for(hf)
    fields = shape_fields(traits, hf)
    return ModelShape(
        family=traits.name,
        config=ShapeConfig(**{k: fields[k] for k in SHAPE_FIELDS if k in fields}),
        vocab_size=int(require(hf, "vocab_size", traits.name)),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
    )


def model_dims_for(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """The dimensions a parallel layout must divide (hf_config.model_dims): num_layers,
    num_attention_heads, num_query_groups, vocab_size, num_experts (None: dense)."""
    hf = load_hf_config(source)
    traits = traits_for(hf)
    return model_dims(hf, traits.name, traits.moe)
