"""Llama (dense): GQA, no biases (attention_bias / mlp_bias must be false), RoPE without scaling."""
from __future__ import annotations

from typing import Any, Mapping

from model_specs.common import ModelSpec, build_model_spec
from model_specs.traits import FAMILY_TRAITS

TRAITS = FAMILY_TRAITS["llama"]


def model_spec(hf_config: Mapping[str, Any], **kwargs: Any) -> ModelSpec:
    """See common.build_model_spec (params_dtype, overrides, transformer_engine); mlp_bias=true is
    refused there (shape.shape_fields)."""
    return build_model_spec(TRAITS, hf_config, **kwargs)
