"""Model features: what one architectural trait adds to a decoder, each in one place.

    class QKNorm(Feature):                             # a feature (features/attention.py)
        def fields(self, hf, draft):
            draft.config["qk_layernorm"] = True
        def weight_rules(self, hf, rules):
            return rules + [WeightRule(L + "self_attention.q_layernorm.weight", ...), ...]

A family (families/) is a list of features; build.build_model_spec, shape.model_fields and
weights.maps.weight_map_for loop over it, each asking every feature in order:
- `fields(hf, draft)`: its TransformerConfig fields (and GPTModel's rope arguments) from the HF
  config, refusing by the field's name what megatron-core would compute differently. Torch-free:
  the planner and the command line's early checks read them without torch.
- `config_fields(kwargs, build)`: the fields that need torch (an activation function, dtypes),
  before the caller's overrides; `settle(kwargs, build)`: after them, what the feature must force
  (a fusion off) or refuse (a layout it cannot run under).
- `config_class(draft)`: the TransformerConfig subclass it needs, if any (MLA's, YaRN's).
- `block_config(config)` and `layer_spec(spec, layer)`: the layer spec megatron builds, rewritten
  (spec_rewrite.py) to the feature's modules; a feature that defines megatron modules is a
  package whose `layers.py` holds them, imported only here (its `__init__` stays torch-free).
- `weight_rules(hf, rules)`: the HF <-> megatron weight map's rules with its own added, or others'
  restricted or replaced (weights/rules.py).
- `local_spec_only`: why Transformer Engine's layer spec is refused, if it is; `quantization`: the
  HF quant_methods the converter dequantizes for it; `moe`: it makes routed-expert layers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

if TYPE_CHECKING:
    import torch
    from megatron.core.transformer import TransformerConfig

    from model_specs.weights.rules import WeightRule


@dataclass
class Draft:
    """What the features have mapped of one HF config so far (torch-free)."""

    family: str
    """The family's name, for messages."""
    features: tuple[Feature, ...]
    """Every feature of the family, the decoder first."""
    config: dict[str, Any] = field(default_factory=dict)
    """TransformerConfig fields."""
    gpt_model: dict[str, Any] = field(default_factory=dict)
    """GPTModel's position_embedding_type, rotary_percent and rotary_base."""


@dataclass(frozen=True)
class BuildContext:
    """What a feature sees of one model's build (build.build_model_spec)."""

    family: str
    params_dtype: torch.dtype
    transformer_engine: bool
    """The layer spec is Transformer Engine's."""


@dataclass(frozen=True)
class LayerContext:
    """The layer spec being built: the model's config, the backend and the pipeline stage."""

    config: TransformerConfig
    transformer_engine: bool
    vp_stage: int | None
    pp_rank: int | None


class Feature:
    """One architectural feature (module docstring); every hook does nothing by default."""

    local_spec_only: ClassVar[str | None] = None
    quantization: ClassVar[tuple[str, ...]] = ()
    moe: ClassVar[bool] = False

    def fields(self, hf: Mapping[str, Any], draft: Draft) -> None:
        """Add this feature's TransformerConfig fields to draft.config (torch-free)."""

    def config_fields(self, kwargs: dict[str, Any], build: BuildContext) -> None:
        """Add the fields that need torch, before the caller's overrides."""

    def settle(self, kwargs: dict[str, Any], build: BuildContext) -> None:
        """Force or refuse fields after the caller's overrides (the layout, the machine's)."""

    def config_class(self, draft: Draft) -> type | None:
        """The TransformerConfig subclass this feature needs, or None."""
        return None

    def block_config(self, config: TransformerConfig) -> TransformerConfig:
        """The config megatron's own block spec is built from (the model's, by default)."""
        return config

    def layer_spec(self, spec: Any, layer: LayerContext) -> Any:
        """megatron's block spec with this feature's modules put in."""
        return spec

    def weight_rules(self, hf: Mapping[str, Any], rules: list[WeightRule]) -> list[WeightRule]:
        """The weight map's rules once this feature has added, restricted or replaced its own."""
        return rules
