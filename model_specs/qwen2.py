"""Qwen2 (dense): GQA with a bias on q/k/v (no other biases), no QK-norm, RoPE."""
from __future__ import annotations

from typing import Any, Mapping

from model_specs.common import ModelSpec, build_model_spec
from model_specs.traits import FAMILY_TRAITS

TRAITS = FAMILY_TRAITS["qwen2"]


def model_spec(hf_config: Mapping[str, Any], **kwargs: Any) -> ModelSpec:
    """See common.build_model_spec (params_dtype, overrides, transformer_engine)."""
    return build_model_spec(TRAITS, hf_config, **kwargs)
