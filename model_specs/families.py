"""The table of model families and the entry points over it (re-exported by the package).

    family = family_for(hf)                            # FAMILIES["qwen3_moe"], a Family
    spec = family.model_spec(hf, overrides={"tensor_model_parallel_size": 2})
    tiny = FAMILIES["qwen3_moe"].tiny_hf_config(num_hidden_layers=6)   # the tests' tiny config

A family is plain data: its row in traits.FAMILY_TRAITS (what its HF configs look like, and the
architecture described above the row) and its tiny test config in tiny.py; common.build_model_spec
maps every family. Adding a family is a row in that table (and, for the tests, a function in
tiny.py named in _TINY_CONFIGS).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from model_specs.hf import tiny
from model_specs.build import ModelSpec, build_model_spec
from model_specs.hf.config import load_hf_config
from model_specs.traits import FAMILY_TRAITS, FamilyTraits, traits_for


@dataclass(frozen=True)
class Family:
    """One decoder family: its traits and the tests' tiny config."""

    traits: FamilyTraits
    tiny: Callable[..., dict[str, Any]] | None = None
    """tiny.py's config function of the family; None where the tests need none (qwen2, llama:
    they reuse tiny Qwen3 with another model_type)."""

    @property
    def name(self) -> str:
        return self.traits.name

    def model_spec(self, hf_config: Mapping[str, Any], **kwargs: Any) -> ModelSpec:
        """See common.build_model_spec (params_dtype, overrides, transformer_engine)."""
        return build_model_spec(self.traits, hf_config, **kwargs)

    def tiny_hf_config(self, **overrides: Any) -> dict[str, Any]:
        """The tests' tiny HF config of this family, with `overrides` applied."""
        if self.tiny is None:
            raise LookupError(f"family {self.name!r} has no tiny config in model_specs/hf/tiny.py; "
                              f"families with one: {[n for n, f in FAMILIES.items() if f.tiny]}")
        return self.tiny(**overrides)


_TINY_CONFIGS = {"qwen3": tiny.qwen3, "qwen3_moe": tiny.qwen3_moe, "qwen2_moe": tiny.qwen2_moe,
                 "glm4_moe": tiny.glm4_moe, "deepseek_v3": tiny.deepseek_v3,
                 "gpt_oss": tiny.gpt_oss, "qwen3_next": tiny.qwen3_next}
FAMILIES: dict[str, Family] = {name: Family(traits, _TINY_CONFIGS.get(name))
                               for name, traits in FAMILY_TRAITS.items()}


def family_for(hf_config: Mapping[str, Any]) -> Family:
    """The family of a normalised HF config; an unknown model_type is refused by name."""
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
