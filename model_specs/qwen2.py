"""Qwen2 (dense): GQA with a bias on q/k/v (no other biases), no QK-norm, RoPE."""
from __future__ import annotations

from typing import Any, Mapping

import torch

from gspo_megatron.parallel.layout import ParallelLayout
from model_specs.common import FamilyTraits, ModelSpec, build_model_spec

TRAITS = FamilyTraits(name="qwen2", model_types=("qwen2",), qkv_bias=True)


def model_spec(hf_config: Mapping[str, Any], layout: ParallelLayout, *,
               params_dtype: torch.dtype = torch.float32, overrides=None) -> ModelSpec:
    return build_model_spec(TRAITS, hf_config, layout, params_dtype=params_dtype, overrides=overrides)
