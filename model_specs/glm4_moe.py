"""GLM-4.5 / GLM-4.6 / GLM-4.5-Air (Glm4MoeForCausalLM): GQA with q/k/v bias, optional QK-norm
(`use_qk_norm`), partial RoPE (`partial_rotary_factor`, the first half of each head rotated),
the first `first_k_dense_replace` layers dense, then MoE layers with a sigmoid router whose expert
bias (`e_score_correction_bias`) enters only the choice of experts, group-limited top-k
(`n_group` / `topk_group`), `routed_scaling_factor`, and `n_shared_experts` ungated shared experts.

The multi-token-prediction layers of the published checkpoints (`num_nextn_predict_layers`,
`model.layers.{num_hidden_layers}.*`) are not part of the model: transformers ignores them when
loading (modeling_glm4_moe.py, _keys_to_ignore_on_load_unexpected), so does this mapping
(weight_maps.WeightMap.ignores_hf).
"""
from __future__ import annotations

from typing import Any, Mapping

from model_specs.common import FamilyTraits, ModelSpec, build_model_spec

TRAITS = FamilyTraits(name="glm4_moe", model_types=("glm4_moe",), qk_norm_field="use_qk_norm",
                      moe=True, router="sigmoid", shared_expert="plain", partial_rotary=True)


def model_spec(hf_config: Mapping[str, Any], **kwargs: Any) -> ModelSpec:
    """See common.build_model_spec (params_dtype, overrides, transformer_engine)."""
    return build_model_spec(TRAITS, hf_config, **kwargs)


def tiny_hf_config(**overrides: Any) -> dict[str, Any]:
    """A tiny GLM-4.5-shaped config for tests: 4 layers (1 dense), 8 experts top-2 in 2 groups
    (1 chosen), routed_scaling_factor 2.5, one shared expert, QK-norm, q/k/v bias, half-rotary
    heads of 16 channels, 4/2 heads (TP2)."""
    cfg = dict(
        architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", vocab_size=512,
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, hidden_act="silu", max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=1000000.0, partial_rotary_factor=0.5,
        tie_word_embeddings=False, attention_bias=True, use_qk_norm=True, initializer_range=0.02,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, num_nextn_predict_layers=0, torch_dtype="float32",
    )
    cfg.update(overrides)
    return cfg
