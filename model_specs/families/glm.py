"""GLM-4.5 / GLM-4.6 / GLM-4.5-Air (Glm4MoeForCausalLM)."""
from __future__ import annotations

from model_specs.families import Family
from model_specs.features.attention import GQA, QKNorm
from model_specs.features.moe import MoE
from model_specs.features.rope import Rope
from model_specs.features.sigmoid_router import SigmoidRouter
from model_specs.hf import tiny

FAMILIES = (
    # GQA with q/k/v bias (`attention_bias`), optional QK-norm (`use_qk_norm`), partial RoPE
    # (`partial_rotary_factor`, the first half of each head rotated), the first
    # `first_k_dense_replace` layers dense, then MoE layers with a sigmoid router whose expert bias
    # (`e_score_correction_bias`) enters only the choice of experts, group-limited top-k
    # (`n_group` / `topk_group`), `routed_scaling_factor`, and `n_shared_experts` ungated shared
    # experts. The multi-token-prediction layers of the published checkpoints
    # (`num_nextn_predict_layers`, `model.layers.{num_hidden_layers}.*`) are not part of the
    # model: transformers ignores them when loading (modeling_glm4_moe.py,
    # _keys_to_ignore_on_load_unexpected), so does the weight map (weights/maps.py, ignores_hf).
    Family("glm4_moe", ("glm4_moe",),
           (GQA(), QKNorm(field="use_qk_norm"), Rope(partial=True), MoE(shared_expert="plain"),
            SigmoidRouter()),
           tiny=tiny.glm4_moe),
)
