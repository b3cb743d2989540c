"""gpt-oss (GptOssForCausalLM)."""
from __future__ import annotations

from model_specs.families import Family
from model_specs.features.attention import GQA
from model_specs.features.clamped_swiglu import ClampedSwiGLU
from model_specs.features.linear_bias import LinearBias
from model_specs.features.moe import MoE, SoftmaxRouter
from model_specs.features.rope import Rope
from model_specs.features.sinks import AttentionSinks
from model_specs.features.sliding_window import SlidingWindow
from model_specs.features.stacked_experts import StackedExperts
from model_specs.hf import tiny

FAMILIES = (
    # GQA (head_dim 64) with a bias on q/k/v/o, one learnable attention sink per head (a logit
    # added to each softmax's denominator), sliding-window attention on the layers `layer_types`
    # names (alternate ones), YaRN; every layer MoE: a router with a bias, top-k then softmax over
    # the k logits, experts with biases and a clamped SwiGLU, (up + 1) * gate * sigmoid(1.702
    # gate) (gate clamped above, up both sides at swiglu_limit); experts stacked per layer in the
    # HF files, MXFP4 in the published ones (dequantized by the converter:
    # gspo_megatron/checkpoint/mxfp4.py).
    Family("gpt_oss", ("gpt_oss",),
           (GQA(qkv_bias=True), LinearBias(), AttentionSinks(), SlidingWindow(), Rope(),
            MoE(expert_size_field="intermediate_size"), SoftmaxRouter(), StackedExperts(),
            ClampedSwiGLU()),
           tiny=tiny.gpt_oss),
)
