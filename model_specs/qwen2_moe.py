"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (GQA, q/k/v bias, no QK-norm) +
routed experts (softmax router, top-k, norm_topk_prob) + one shared expert scaled by
sigmoid(shared_expert_gate(x)); `mlp_only_layers` / `decoder_sparse_step` pick dense layers."""
from __future__ import annotations

from typing import Any, Mapping

from model_specs.common import FamilyTraits, ModelSpec, build_model_spec

TRAITS = FamilyTraits(name="qwen2_moe", model_types=("qwen2_moe",), qkv_bias=True, moe=True,
                      router="softmax", shared_expert="gated")


def model_spec(hf_config: Mapping[str, Any], **kwargs: Any) -> ModelSpec:
    """See common.build_model_spec (params_dtype, overrides, transformer_engine)."""
    return build_model_spec(TRAITS, hf_config, **kwargs)


def tiny_hf_config(**overrides: Any) -> dict[str, Any]:
    """A tiny Qwen2-MoE config for tests: 4 layers, 4 experts top-2 (EP2) + a gated shared expert,
    4/2 heads (TP2), full-softmax routing weights (norm_topk_prob false, as Qwen2-57B-A14B)."""
    cfg = dict(
        architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", vocab_size=512,
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=False, qkv_bias=True, initializer_range=0.02,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, norm_topk_prob=False, decoder_sparse_step=1,
        mlp_only_layers=[], use_sliding_window=False, router_aux_loss_coef=0.0,
        output_router_logits=False, torch_dtype="float32",
    )
    cfg.update(overrides)
    return cfg
