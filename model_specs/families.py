"""The table of model families and the entry points over it (re-exported by the package)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from model_specs import glm4_moe, llama, qwen2, qwen2_moe, qwen3, qwen3_moe
from model_specs.common import ModelSpec
from model_specs.hf_config import HFConfigError, load_hf_config, model_dims

FAMILIES = {m.TRAITS.name: m for m in (qwen3, qwen3_moe, qwen2, qwen2_moe, glm4_moe, llama)}
_BY_MODEL_TYPE = {t: m for m in FAMILIES.values() for t in m.TRAITS.model_types}


def family_for(hf_config: Mapping[str, Any]):
    """The family module (qwen3, qwen3_moe, ...) of a normalised HF config."""
    model_type = hf_config.get("model_type")
    if model_type not in _BY_MODEL_TYPE:
        raise HFConfigError(f"unknown architecture: model_type={model_type!r} "
                            f"(architectures={hf_config.get('architectures')}); supported: "
                            f"{sorted(_BY_MODEL_TYPE)}")
    return _BY_MODEL_TYPE[model_type]


def model_dims_for(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """The dimensions a parallel layout must divide (hf_config.model_dims): num_layers,
    num_attention_heads, num_query_groups, vocab_size, num_experts (None: dense)."""
    hf = load_hf_config(source)
    traits = family_for(hf).TRAITS
    return model_dims(hf, traits.name, traits.moe)


def model_spec_for(source: str | Path | Mapping[str, Any], *,
                   params_dtype: torch.dtype = torch.float32,
                   overrides: Mapping[str, Any] | None = None,
                   transformer_engine: bool | None = None) -> ModelSpec:
    """The ModelSpec of an HF model (dict, config.json or model directory); see
    common.build_model_spec for `overrides` and `transformer_engine`."""
    hf = load_hf_config(source)
    return family_for(hf).model_spec(hf, params_dtype=params_dtype, overrides=overrides,
                                     transformer_engine=transformer_engine)

