"""Model families: HF config.json -> megatron-core TransformerConfig + layer spec.

    spec = model_spec_for(hf_config_or_dir, ParallelLayout(tensor=2))
    model = GPTModel(spec.config, spec.block_spec(vp_stage), **spec.gpt_model_kwargs(), ...)
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from gspo_megatron.parallel.layout import ParallelLayout
from model_specs import llama, qwen2, qwen3, qwen3_moe
from model_specs.common import ConfigError, ModelSpec, load_hf_config

FAMILIES = {m.TRAITS.name: m for m in (qwen3, qwen3_moe, qwen2, llama)}
_BY_MODEL_TYPE = {t: m for m in FAMILIES.values() for t in m.TRAITS.model_types}


def family_for(hf_config: Mapping[str, Any]):
    model_type = hf_config.get("model_type")
    if model_type not in _BY_MODEL_TYPE:
        raise ConfigError(f"unknown architecture: model_type={model_type!r} "
                          f"(architectures={hf_config.get('architectures')}); supported: "
                          f"{sorted(_BY_MODEL_TYPE)}")
    return _BY_MODEL_TYPE[model_type]


def model_spec_for(source: str | Path | Mapping[str, Any], layout: ParallelLayout, *,
                   params_dtype: torch.dtype = torch.float32,
                   overrides: Mapping[str, Any] | None = None) -> ModelSpec:
    hf = load_hf_config(source)
    return family_for(hf).model_spec(hf, layout, params_dtype=params_dtype, overrides=overrides)


__all__ = ["ConfigError", "FAMILIES", "ModelSpec", "family_for", "load_hf_config",
           "model_spec_for"]
