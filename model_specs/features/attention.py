"""Grouped-query attention (megatron's SelfAttention with a fused linear_qkv) and what families add
to it: QK-norm and an output gate. megatron builds all three from config fields; what is theirs
here is the mapping of the HF config and the weights (the fused layouts: weights/layouts.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from model_specs.features import Draft, Feature
from model_specs.weights.rules import QKV, H, L, WeightRule


def head_dim(hf: Mapping[str, Any]) -> int:
    """An attention head's width: `head_dim`, or hidden_size / num_attention_heads."""
    return int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))


@dataclass(frozen=True)
class GQA(Feature):
    """q, k and v projections of the hidden state (megatron's fused linear_qkv), with a bias
    unless the config says `qkv_bias: false` (Qwen2-MoE spells it so) when `qkv_bias`, and with
    one wherever `attention_bias: true`."""

    qkv_bias: bool = False

    def has_bias(self, hf: Mapping[str, Any]) -> bool:
        return bool(hf.get("qkv_bias", self.qkv_bias)) or bool(hf.get("attention_bias", False))

    def fields(self, hf: Mapping[str, Any], draft: Draft) -> None:
        draft.config.update(kv_channels=head_dim(hf), add_qkv_bias=self.has_bias(hf))

    def weight_rules(self, hf: Mapping[str, Any], rules: list[WeightRule]) -> list[WeightRule]:
        heads = int(hf["num_attention_heads"])
        layout = (heads, int(hf.get("num_key_value_heads") or heads), head_dim(hf), 0)
        mine = [WeightRule(L + f"self_attention.linear_qkv.{p}",
                           tuple(H + f"self_attn.{x}_proj.{p}" for x in "qkv"), QKV, tp_dim=0,
                           layout=layout)
                for p in ("weight", "bias") if p == "weight" or self.has_bias(hf)]
        return rules + mine


@dataclass(frozen=True)
class QKNorm(Feature):
    """An RMSNorm over each head's q and k before RoPE; always, or where the config's `field`
    is true (GLM-4.5: use_qk_norm)."""

    field: str | None = None

    def on(self, hf: Mapping[str, Any]) -> bool:
        return self.field is None or bool(hf.get(self.field))

    def fields(self, hf: Mapping[str, Any], draft: Draft) -> None:
        draft.config["qk_layernorm"] = self.on(hf)

    def weight_rules(self, hf: Mapping[str, Any], rules: list[WeightRule]) -> list[WeightRule]:
        if not self.on(hf):
            return rules
        return rules + [WeightRule(L + f"self_attention.{x}_layernorm.weight",
                                   (H + f"self_attn.{x}_norm.weight",)) for x in "qk"]


@dataclass(frozen=True)
class GatedAttention(Feature):
    """Qwen3-Next's output gate: q_proj also yields one gate per channel, and the attention's
    output is multiplied by its sigmoid before o_proj (megatron's attention_output_gate); the
    gate rows join linear_qkv (weights/layouts.py)."""

    def fields(self, hf: Mapping[str, Any], draft: Draft) -> None:
        draft.config["attention_output_gate"] = True

    def weight_rules(self, hf: Mapping[str, Any], rules: list[WeightRule]) -> list[WeightRule]:
        return [replace(r, layout=r.layout[:3] + (1,)) if r.kind == QKV else r for r in rules]
