"""Model families: HF config.json -> megatron-core TransformerConfig + layer spec + weight map.

    spec = model_spec_for(hf_config_or_dir, overrides={"tensor_model_parallel_size": 2, ...})
    model = GPTModel(spec.config, spec.block_spec(vp_stage), **spec.gpt_model_kwargs(), ...)

A leaf package: it knows Hugging Face configs and megatron-core, nothing of the RL library. The
caller (gspo_megatron's actor, the checkpoint converters) supplies the parallel layout and the
machine's adaptations as TransformerConfig overrides.

    features/    one module (or package, with its megatron modules in layers.py) per feature:
                 its config fields, refusals, layer-spec rewrite and weight rules
    families/    the families, each a list of features declared in one place
    build.py     a family's features -> ModelSpec; shape.py: the same fields, torch-free
    weights/     the HF <-> megatron weight map of a model (its features' rules), fused layouts
    hf/          config.json, tensor shapes, the published and the tests' tiny configs

Names are imported on first use (PEP 562). `hf`, `families`, the features' `__init__`s, `shape`
and `param_count` are torch-free: the command line's early checks and the planner read them
before (or without) torch and megatron-core.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from model_specs import lazy_compile

lazy_compile.install()  # megatron-core's fusions compile on first use, not at import, without CUDA

_EXPORTS = {"FAMILIES": "families", "family_for": "families", "model_dims_for": "shape",
            "model_shape_for": "shape", "ModelShape": "shape",
            "model_spec_for": "build", "ModelSpec": "build", "HFConfigError": "hf.config",
            "load_hf_config": "hf.config"}


if TYPE_CHECKING:  # the names as the checker sees them; at run time __getattr__ imports them
    from model_specs.build import ModelSpec, model_spec_for
    from model_specs.families import FAMILIES, family_for
    from model_specs.hf.config import HFConfigError, load_hf_config
    from model_specs.shape import ModelShape, model_dims_for, model_shape_for
else:
    def __getattr__(name: str) -> Any:
        if name in _EXPORTS:
            return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
