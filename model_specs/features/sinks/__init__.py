"""Attention sinks (gpt-oss): one learnable logit per head added to each softmax's denominator,
megatron-core's learnable softmax offset (the `AttentionSinks` feature; layers.py).

The layer spec is megatron's local one: Transformer Engine's attention takes `softmax_type` from
TE 2.8 on (TEDotProductAttention.__init__) and keeps the offset inside TE, where no test of
this project has looked at its TP split; the local spec is built for a family with sinks, and
transformer_engine=True is refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from model_specs.features import Draft, Feature, LayerContext
from model_specs.weights.rules import H, L, WeightRule


@dataclass(frozen=True)
class AttentionSinks(Feature):
    """A sink logit per head (module docstring)."""

    local_spec_only = ("attention sinks with Transformer Engine's layer spec are not supported: TE "
                       "keeps the sinks inside its attention, where no test of this project has "
                       "checked their split over TP ranks (model_specs/features/sinks/)")

    def fields(self, hf: Mapping[str, Any], draft: Draft) -> None:
        draft.config["softmax_type"] = "learnable"

    def layer_spec(self, spec: Any, layer: LayerContext) -> Any:
        from model_specs.features.sinks.layers import use_sink_attention
        return use_sink_attention(spec)

    def weight_rules(self, hf: Mapping[str, Any], rules: list[WeightRule]) -> list[WeightRule]:
        # megatron's learnable softmax offset is HF's sinks: one logit per head
        return rules + [WeightRule(L + "self_attention.core_attention.softmax_offset",
                                   (H + "self_attn.sinks",), tp_dim=0, slot="attention_out")]
