"""gpt-oss's clamped SwiGLU (the `ClampedSwiGLU` feature): HF's
`(up.clamp(-l, l) + 1) * g * sigmoid(1.702 g)`, g = gate.clamp(max=l), is megatron's GLU with
`activation_func=quick_gelu`, `glu_linear_offset=1`, `activation_func_clamp_value=l`
(MLP.forward's glu; the expert fused kernel, weighted_bias_quick_geglu_impl, takes the same two
fields). HF interleaves gate and up in `gate_up_proj` ([..., ::2], [..., 1::2]); megatron's fc1
is [gate; up]: stacked_experts.py de-interleaves.

It runs unfused: megatron's fused bias-activation path takes quick_gelu only with per-token scales
(MLP.forward, "Only support fusion of gelu and swiglu" otherwise), and TransformerConfig
refuses the fusion for activations.quick_gelu (TransformerConfig.__post_init__, which compares
with fused_bias_geglu.quick_gelu); the CUDA defaults turn the fusion on (actor/settings.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from model_specs.features import BuildContext, Draft, Feature
from model_specs.hf.config import HFConfigError

# megatron-core's activations.quick_gelu is x * sigmoid(1.702 x), the only GLU activation
# with an offset and a clamp its fused kernel takes (TransformerConfig.__post_init__)
QUICK_GELU_ALPHA = 1.702


@dataclass(frozen=True)
class ClampedSwiGLU(Feature):
    """The MLPs' and experts' activation: SwiGLU clamped at `swiglu_limit` (module docstring)."""

    def fields(self, hf: Mapping[str, Any], draft: Draft) -> None:
        family = draft.family
        alpha = float(hf.get("swiglu_alpha", QUICK_GELU_ALPHA))
        if alpha != QUICK_GELU_ALPHA:
            raise HFConfigError(f"{family}: swiglu_alpha={alpha} is not supported: megatron-core's "
                                f"clamped GLU takes quick_gelu, x * sigmoid({QUICK_GELU_ALPHA} x) "
                                "(activations.quick_gelu)")
        limit = hf.get("swiglu_limit", 7.0)
        if limit is None or float(limit) <= 0:
            raise HFConfigError(f"{family}: swiglu_limit={limit}, expected a number > 0")
        draft.config.update(glu_linear_offset=1.0, activation_func_clamp_value=float(limit))

    def config_fields(self, kwargs: dict[str, Any], build: BuildContext) -> None:
        from megatron.core.activations import quick_gelu
        kwargs["activation_func"] = quick_gelu

    def settle(self, kwargs: dict[str, Any], build: BuildContext) -> None:
        if kwargs.get("activation_func_clamp_value") is not None:
            kwargs["bias_activation_fusion"] = False  # unfused (module docstring)
