"""gpt-oss's attention and experts in megatron-core: attention sinks, sliding windows, biases and
the clamped SwiGLU, each against transformers' modeling_gpt_oss.py (the fields: gpt_oss_fields.py).

- Attention sinks: HF appends each head's `sinks` logit to every row of attention scores, takes
  the softmax and drops the sink's column (eager_attention_forward). megatron-core's learnable
  softmax (`softmax_type="learnable"`) does the same with its per-head `softmax_offset`
  (fused_softmax.py:154-176, SoftmaxOne; dot_product_attention.py:126-138). The parameter is split
  over TP ranks by heads (num_attention_heads_per_partition) but megatron does not mark it so
  (only its sharded_state_dict knows the axis, dot_product_attention.py:267), so the full-tensor
  paths of this project (actor/weights.py, the sync) would take one rank's heads for all:
  `SinkDotProductAttention` marks it `tensor_model_parallel` along dim 0.
- Sliding windows: `window_size` = (sliding_window - 1, 0) on the layers `window_attn_skip_freq`
  lists (utils.py:451-462: a list entry per layer, 1 = windowed); the local softmax then builds
  its own banded causal mask (fused_softmax.py:321). With a sink every masked score still has
  weight exp(-10000 - max) = 0 in fp32, as HF's -inf.
- Biases: `add_bias_linear` gives the output projection, the router (router.py:56, its logits by
  addmm, moe_utils.py:1196) and every expert's fc1 / fc2 a bias, as gpt-oss has and nothing else.
  An expert's fc2 bias is added once per token times its routing weight (mlp.py:247), as HF adds
  down_proj_bias before weighting. Under expert-tensor parallelism each expert-TP rank adds it to
  its partial sum before the ranks' sums are reduced (tensor_parallel/layers.py:1286, no reduce
  for experts), so the bias would count expert_tensor_parallel_size times; megatron asserts
  ETP == 1 for MoE with biases (transformer_config.py:1590), and common.py refuses it first, by
  name, with the setting to change.
- The layer spec is megatron's local one: Transformer Engine's attention takes `softmax_type`
  from TE 2.8 on (extensions/transformer_engine.py:1283) and keeps the offset inside TE, where no
  test of this project has looked at its TP split; common.py builds the local spec for gpt-oss
  and refuses transformer_engine=True by name.
- The clamped SwiGLU: HF's `(up.clamp(-l, l) + 1) * g * sigmoid(1.702 g)`, g = gate.clamp(max=l),
  is megatron's GLU with `activation_func=quick_gelu`, `glu_linear_offset=1`,
  `activation_func_clamp_value=l` (mlp.py:219-226; the expert fused kernel,
  weighted_bias_quick_geglu_impl, takes the same two fields). HF interleaves gate and up in
  `gate_up_proj` ([..., ::2], [..., 1::2]); megatron's fc1 is [gate; up]: weight_maps.py
  de-interleaves.
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
