"""Zero-centred RMSNorms (Qwen3-Next): (1 + weight) * x / rms(x), megatron-core's
`layernorm_zero_centered_gamma` (TE's RMSNorm with zero_centered_gamma; the local spec's:
norms.ZeroCenteredRMSNorm). The weights are HF's as they are: transformers' Qwen3NextRMSNorm
computes the same (the Gated DeltaNet's own output norm is not zero-centred:
gated_delta_net/layers.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from model_specs.features import Draft, Feature


@dataclass(frozen=True)
class ZeroCenteredNorms(Feature):
    """Every norm of the decoder zero-centred (module docstring)."""

    def fields(self, hf: Mapping[str, Any], draft: Draft) -> None:
        draft.config["layernorm_zero_centered_gamma"] = True
