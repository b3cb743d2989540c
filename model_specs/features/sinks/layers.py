"""Attention sinks in megatron-core's local spec (the feature: __init__.py).

HF appends each head's `sinks` logit to every row of attention scores, takes the softmax and drops
the sink's column (transformers modeling_gpt_oss.py, eager_attention_forward). megatron-core's
learnable softmax (`softmax_type="learnable"`) does the same with its per-head `softmax_offset`
(fused_softmax.py SoftmaxOne; DotProductAttention.__init__). The parameter is split
over TP ranks by heads (num_attention_heads_per_partition) but megatron does not mark it so (only
its sharded_state_dict knows the axis), so the full-tensor paths of
this project (actor/weights/full.py, the sync) would take one rank's heads for all:
`SinkDotProductAttention` marks it `tensor_model_parallel` along dim 0.
"""
from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.dot_product_attention import DotProductAttention

from model_specs.spec_rewrite import rewrite_spec


class SinkDotProductAttention(DotProductAttention):
    """megatron-core's DotProductAttention whose learnable softmax offset (the sinks) is marked as
    split over TP ranks along its only dimension (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(self.softmax_offset, torch.nn.Parameter):
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)


def use_sink_attention(spec: Any) -> Any:
    """A copy of a local block / layer spec whose core attention is SinkDotProductAttention."""
    return rewrite_spec(spec, lambda s: SinkDotProductAttention if s is DotProductAttention else None)
