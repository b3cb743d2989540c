"""The decoder families' traits: what distinguishes one family's HF config from another's.

Torch-free (plain data), so that the planner and the command line's early checks can tell a
model's family and shape without importing torch or megatron-core (shape.py). The family modules
(qwen3.py, ...) take their TRAITS from `FAMILY_TRAITS`; families.py maps a config to its module.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from model_specs.hf_config import HFConfigError


@dataclass(frozen=True)
class FamilyTraits:
    """What distinguishes one decoder family's HF config from another's."""

    name: str
    """The family's name (FAMILIES key)."""
    model_types: tuple[str, ...]
    """HF `model_type` values of the family."""
    qk_layernorm: bool = False
    """Always QK-norm (RMSNorm over each head's q and k before RoPE)."""
    qk_norm_field: str | None = None
    """A config field that turns QK-norm on (GLM-4.5: use_qk_norm)."""
    qkv_bias: bool = False
    """q/k/v have a bias unless the config says `qkv_bias: false` (Qwen2-MoE spells it so);
    `attention_bias: true` also turns it on."""
    moe: bool = False
    """Routed experts (moe.py)."""
    router: str = "softmax"
    """MoE router: "softmax" (Qwen) or "sigmoid" (GLM-4.5: expert bias, groups, scaling)."""
    shared_expert: str | None = None
    """None, "gated" (Qwen2-MoE) or "plain" (GLM-4.5); see moe.py."""
    partial_rotary: bool = False
    """The HF class rotates only `partial_rotary_factor` of each head (GLM-4.5)."""


FAMILY_TRAITS = {t.name: t for t in (
    FamilyTraits(name="qwen3", model_types=("qwen3",), qk_layernorm=True),
    FamilyTraits(name="qwen3_moe", model_types=("qwen3_moe",), qk_layernorm=True, moe=True),
    FamilyTraits(name="qwen2", model_types=("qwen2",), qkv_bias=True),
    FamilyTraits(name="qwen2_moe", model_types=("qwen2_moe",), qkv_bias=True, moe=True,
                 router="softmax", shared_expert="gated"),
    FamilyTraits(name="glm4_moe", model_types=("glm4_moe",), qk_norm_field="use_qk_norm",
                 moe=True, router="sigmoid", shared_expert="plain", partial_rotary=True),
    FamilyTraits(name="llama", model_types=("llama",)),
)}
_BY_MODEL_TYPE = {m: t for t in FAMILY_TRAITS.values() for m in t.model_types}


def traits_for(hf_config: Mapping[str, Any]) -> FamilyTraits:
    """The traits of a normalised HF config's family; an unknown model_type is refused by name."""
    model_type = hf_config.get("model_type")
    if model_type not in _BY_MODEL_TYPE:
        raise HFConfigError(f"unknown architecture: model_type={model_type!r} "
                            f"(architectures={hf_config.get('architectures')}); supported: "
                            f"{sorted(_BY_MODEL_TYPE)}")
    return _BY_MODEL_TYPE[model_type]


def attention_options(traits: FamilyTraits, hf: Mapping[str, Any]) -> tuple[bool, bool]:
    """(QK-norm, q/k/v bias) of a config of this family; the weight map reads the same."""
    qk_norm = traits.qk_layernorm or bool(traits.qk_norm_field and hf.get(traits.qk_norm_field))
    qkv_bias = bool(hf.get("qkv_bias", traits.qkv_bias)) or bool(hf.get("attention_bias", False))
    return qk_norm, qkv_bias
