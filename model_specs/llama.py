"""Llama (dense): GQA, no biases (attention_bias / mlp_bias must be false), RoPE without scaling."""
from __future__ import annotations

from typing import Any, Mapping

import torch

from gspo_megatron.parallel.layout import ParallelLayout
from model_specs.common import ConfigError, FamilyTraits, ModelSpec, build_model_spec

TRAITS = FamilyTraits(name="llama", model_types=("llama",))


def model_spec(hf_config: Mapping[str, Any], layout: ParallelLayout, *,
               params_dtype: torch.dtype = torch.float32, overrides=None) -> ModelSpec:
    if hf_config.get("mlp_bias"):
        raise ConfigError("llama: mlp_bias=true is not supported (megatron add_bias_linear would "
                          "also add a bias to the attention output projection)")
    return build_model_spec(TRAITS, hf_config, layout, params_dtype=params_dtype, overrides=overrides)
