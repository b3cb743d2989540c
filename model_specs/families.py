"""The table of model families and the entry points over it (re-exported by the package)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from model_specs import glm4_moe, llama, qwen2, qwen2_moe, qwen3, qwen3_moe
from model_specs.common import ModelSpec
from model_specs.hf_config import load_hf_config
from model_specs.traits import traits_for

FAMILIES = {m.TRAITS.name: m for m in (qwen3, qwen3_moe, qwen2, qwen2_moe, glm4_moe, llama)}


def family_for(hf_config: Mapping[str, Any]):
    """The family module (qwen3, qwen3_moe, ...) of a normalised HF config."""
    return FAMILIES[traits_for(hf_config).name]


def model_spec_for(source: str | Path | Mapping[str, Any], *,
                   params_dtype: torch.dtype = torch.float32,
                   overrides: Mapping[str, Any] | None = None,
                   transformer_engine: bool | None = None) -> ModelSpec:
    """The ModelSpec of an HF model (dict, config.json or model directory); see
    common.build_model_spec for `overrides` and `transformer_engine`."""
    hf = load_hf_config(source)
    return family_for(hf).model_spec(hf, params_dtype=params_dtype, overrides=overrides,
                                     transformer_engine=transformer_engine)

