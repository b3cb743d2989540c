"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (GQA, q/k/v bias, no QK-norm) +
routed experts (softmax router, top-k, norm_topk_prob) + one shared expert scaled by
sigmoid(shared_expert_gate(x)); `mlp_only_layers` / `decoder_sparse_step` pick dense layers."""
from __future__ import annotations

from typing import Any, Mapping

from model_specs.common import ModelSpec, build_model_spec
from model_specs.tiny import qwen2_moe as tiny_hf_config  # noqa: F401 (the tests' config)
from model_specs.traits import FAMILY_TRAITS

TRAITS = FAMILY_TRAITS["qwen2_moe"]


def model_spec(hf_config: Mapping[str, Any], **kwargs: Any) -> ModelSpec:
    """See common.build_model_spec (params_dtype, overrides, transformer_engine)."""
    return build_model_spec(TRAITS, hf_config, **kwargs)
