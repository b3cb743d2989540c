"""Sliding-window attention (gpt-oss; Mistral's windowed models): megatron-core's `window_size`
on the layers `window_attn_skip_freq` lists (megatron-core utils.get_sliding_window_attention:
a list entry per layer, 1 = windowed); the local softmax then builds its own banded causal mask
(FusedScaleMaskSoftmax.forward_torch_softmax). With an attention sink every masked score still
has weight exp(-10000 - max) = 0 in fp32, as HF's -inf.

transformers keeps key j for query i when j > i - sliding_window (masking_utils.py,
sliding_window_overlay): the query and the window - 1 before it; megatron keeps
i - window_size[0] <= j <= i + window_size[1].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from model_specs.features import Draft, Feature
from model_specs.hf.config import HFConfigError, require

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class SlidingWindow(Feature):
    """A window of `sliding_window` tokens on the layers `layer_types` names "sliding_attention";
    without `layer_types`, on every other layer from the first (`every_layer` false: gpt-oss,
    transformers' GptOssConfig default) or on every layer wherever `sliding_window` is set
    (`every_layer`: MistralConfig)."""

    every_layer: bool = False

    def fields(self, hf: Mapping[str, Any], draft: Draft) -> None:
        family, num_layers = draft.family, draft.config["num_layers"]
        if self.every_layer and hf.get("layer_types") is None:
            kind = "full_attention" if hf.get("sliding_window") is None else "sliding_attention"
            default = [kind] * num_layers
        else:
            default = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                       for i in range(num_layers)]
        layer_types = list(hf.get("layer_types") or default)
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown or len(layer_types) != num_layers:
            raise HFConfigError(f"{family}: layer_types={layer_types} is not supported: expected "
                                f"{num_layers} entries, each one of {LAYER_TYPES}")
        if "sliding_attention" not in layer_types:
            return
        window = int(require(hf, "sliding_window", family))
        if window <= 0:
            raise HFConfigError(f"{family}: sliding_window={window}, expected > 0")
        draft.config.update(window_size=(window - 1, 0),
                            window_attn_skip_freq=[int(t == "sliding_attention")
                                                   for t in layer_types])
