"""The Qwen families: Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE and Qwen3-Next."""
from __future__ import annotations

from model_specs.families import Family
from model_specs.features.attention import GQA, GatedAttention, QKNorm
from model_specs.features.gated_delta_net import GatedDeltaNet
from model_specs.features.moe import MoE, SoftmaxRouter
from model_specs.features.rope import Rope
from model_specs.features.zero_centered_norms import ZeroCenteredNorms
from model_specs.hf import tiny

FAMILIES = (
    # Qwen3 (dense): GQA, QK-norm (RMSNorm on each head's q and k), no qkv bias, RoPE.
    Family("qwen3", ("qwen3",), (GQA(), QKNorm(), Rope()), tiny=tiny.qwen3),
    # Qwen3-MoE: Qwen3 attention (GQA, QK-norm) + routed experts (softmax router, top-k,
    # norm_topk_prob), no shared expert; `mlp_only_layers` / `decoder_sparse_step` pick dense
    # layers.
    Family("qwen3_moe", ("qwen3_moe",), (GQA(), QKNorm(), Rope(), MoE(), SoftmaxRouter()),
           tiny=tiny.qwen3_moe),
    # Qwen2 (dense): GQA with a bias on q/k/v (no other biases), no QK-norm, RoPE.
    Family("qwen2", ("qwen2",), (GQA(qkv_bias=True), Rope())),
    # Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (GQA, q/k/v bias, no QK-norm) +
    # routed experts (softmax router, top-k, norm_topk_prob) + one shared expert scaled by
    # sigmoid(shared_expert_gate(x)); `mlp_only_layers` / `decoder_sparse_step` pick dense layers.
    Family("qwen2_moe", ("qwen2_moe",),
           (GQA(qkv_bias=True), Rope(), MoE(shared_expert="gated"), SoftmaxRouter()),
           tiny=tiny.qwen2_moe),
    # Qwen3-Next (Qwen3NextForCausalLM): three Gated DeltaNet (linear attention) layers to one
    # full-attention layer, that one GQA with QK-norm, partial RoPE and a sigmoid output gate;
    # zero-centred RMSNorms; Qwen2-MoE's MoE block (softmax router, a gated shared expert) on every
    # layer. The multi-token-prediction weights of the published checkpoints (`mtp.*`) are not
    # part of the model (transformers ignores them when loading: weights/maps.IGNORED_HF).
    Family("qwen3_next", ("qwen3_next",),
           (GQA(), QKNorm(), GatedAttention(), Rope(partial=True), GatedDeltaNet(),
            ZeroCenteredNorms(), MoE(shared_expert="gated"), SoftmaxRouter()),
           tiny=tiny.qwen3_next),
)
