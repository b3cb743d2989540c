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

from model_specs.common import ModelSpec, build_model_spec
from model_specs.tiny import glm4_moe as tiny_hf_config  # noqa: F401 (the tests' config)
from model_specs.traits import FAMILY_TRAITS

TRAITS = FAMILY_TRAITS["glm4_moe"]


def model_spec(hf_config: Mapping[str, Any], **kwargs: Any) -> ModelSpec:
    """See common.build_model_spec (params_dtype, overrides, transformer_engine)."""
    return build_model_spec(TRAITS, hf_config, **kwargs)
