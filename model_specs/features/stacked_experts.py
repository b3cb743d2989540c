"""gpt-oss's experts as its HF files hold them (the `StackedExperts` feature): per layer the
router with a bias (`mlp.router`), and every expert in one tensor per kind: `mlp.experts.
gate_up_proj` [E, h, 2 x ffn] with gate and up interleaved, `down_proj` [E, ffn, h], and their
biases; MXFP4 in the published files, dequantized by the converter
(gspo_megatron/checkpoint/mxfp4.py). Each expert's megatron parameter is one slice of a stacked
tensor (weights/maps.py converts them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from model_specs.features import Feature
from model_specs.features.moe import moe_layers
from model_specs.weights.rules import (STACKED, STACKED_GATE_UP, STACKED_GATE_UP_BIAS, STACKED_T, H,
                                       L, WeightRule)


@dataclass(frozen=True)
class StackedExperts(Feature):
    """The router and experts under gpt-oss's names, in place of the MoE feature's (module
    docstring); the biases are LinearBias's, stored here."""

    quantization = ("mxfp4",)

    def weight_rules(self, hf: Mapping[str, Any], rules: list[WeightRule]) -> list[WeightRule]:
        moe = moe_layers(hf)
        e, x = L + "mlp.experts.local_experts.{expert}.", H + "mlp.experts."
        mine = [WeightRule(L + f"mlp.router.{p}", (H + f"mlp.router.{p}",), slot="router",
                           layers=moe) for p in ("weight", "bias")]
        mine += [WeightRule(e + m, (x + h,), kind, tp_dim=tp, scope="expert", slot="experts",
                            layers=moe)
                 for m, h, kind, tp in (
                     ("linear_fc1.weight", "gate_up_proj", STACKED_GATE_UP, 0),
                     ("linear_fc1.bias", "gate_up_proj_bias", STACKED_GATE_UP_BIAS, 0),
                     ("linear_fc2.weight", "down_proj", STACKED_T, 1),
                     ("linear_fc2.bias", "down_proj_bias", STACKED, None))]
        return [r for r in rules if r.slot not in ("router", "experts")] + mine
