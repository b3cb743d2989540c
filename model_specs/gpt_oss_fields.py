"""The TransformerConfig fields of gpt-oss's attention and experts: plain numbers, torch-free, so
that shape.py (the planner) reads the same mapping as the built model. What megatron-core computes
with them, and where: model_specs/sinks.py's docstring.

    fields = gpt_oss_fields(hf, "gpt_oss", num_layers=36)
    fields["window_size"], fields["window_attn_skip_freq"][:2]      # (127, 0), [1, 0]
"""
from __future__ import annotations

from typing import Any, Mapping

from model_specs.hf.config import HFConfigError, require

# megatron-core's quick_gelu is x * sigmoid(1.702 x) (activations.py:15), the only GLU activation
# with an offset and a clamp its fused kernel takes (transformer_config.py:1505)
QUICK_GELU_ALPHA = 1.702
LAYER_TYPES = ("sliding_attention", "full_attention")


def gpt_oss_fields(hf: Mapping[str, Any], family: str, num_layers: int) -> dict[str, Any]:
    """gpt-oss's TransformerConfig fields beyond a Llama's; what megatron would compute
    differently is refused by the field's name."""
    if not hf.get("attention_bias", True):
        raise HFConfigError(f"{family}: attention_bias=false is not supported: megatron-core's "
                            "add_bias_linear gives the output projection, the router and the "
                            "experts a bias too, which the HF model then lacks")
    alpha = float(hf.get("swiglu_alpha", QUICK_GELU_ALPHA))
    if alpha != QUICK_GELU_ALPHA:
        raise HFConfigError(f"{family}: swiglu_alpha={alpha} is not supported: megatron-core's "
                            f"clamped GLU takes quick_gelu, x * sigmoid({QUICK_GELU_ALPHA} x) "
                            "(activations.py:15)")
    limit = hf.get("swiglu_limit", 7.0)
    if limit is None or float(limit) <= 0:
        raise HFConfigError(f"{family}: swiglu_limit={limit}, expected a number > 0")
    layer_types = list(hf.get("layer_types") or
                       ["sliding_attention" if (i + 1) % 2 else "full_attention"
                        for i in range(num_layers)])  # transformers' default (GptOssConfig)
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown or len(layer_types) != num_layers:
        raise HFConfigError(f"{family}: layer_types={layer_types} is not supported: expected "
                            f"{num_layers} entries, each one of {LAYER_TYPES}")
    fields: dict[str, Any] = dict(
        add_bias_linear=True,
        softmax_type="learnable",
        glu_linear_offset=1.0,
        activation_func_clamp_value=float(limit),
    )
    if "sliding_attention" in layer_types:
        window = int(require(hf, "sliding_window", family))
        if window <= 0:
            raise HFConfigError(f"{family}: sliding_window={window}, expected > 0")
        # transformers keeps key j for query i when j > i - sliding_window (masking_utils.py,
        # sliding_window_overlay): the query and the window - 1 before it; megatron keeps
        # i - window_size[0] <= j <= i + window_size[1] (utils.py:38-44)
        fields.update(window_size=(window - 1, 0),
                      window_attn_skip_freq=[int(t == "sliding_attention") for t in layer_types])
    return fields
