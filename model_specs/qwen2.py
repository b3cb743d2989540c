"""Qwen2 (dense): GQA with a bias on q/k/v (no other biases), no QK-norm, RoPE."""
from __future__ import annotations

from typing import Any, Mapping

from model_specs.common import FamilyTraits, ModelSpec, build_model_spec

TRAITS = FamilyTraits(name="qwen2", model_types=("qwen2",), qkv_bias=True)


def model_spec(hf_config: Mapping[str, Any], **kwargs: Any) -> ModelSpec:
    """See common.build_model_spec (params_dtype, overrides, transformer_engine)."""
    return build_model_spec(TRAITS, hf_config, **kwargs)
