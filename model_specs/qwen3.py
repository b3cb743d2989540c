"""Qwen3 (dense): GQA, QK-norm (RMSNorm on each head's q and k), no qkv bias, RoPE."""
from __future__ import annotations

from typing import Any, Mapping

from model_specs.common import ModelSpec, build_model_spec
from model_specs.tiny import qwen3 as tiny_hf_config  # noqa: F401 (the tests' config)
from model_specs.traits import FAMILY_TRAITS

TRAITS = FAMILY_TRAITS["qwen3"]


def model_spec(hf_config: Mapping[str, Any], **kwargs: Any) -> ModelSpec:
    """See common.build_model_spec (params_dtype, overrides, transformer_engine)."""
    return build_model_spec(TRAITS, hf_config, **kwargs)
