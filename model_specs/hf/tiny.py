"""The tests' tiny configs of each family (HF config dicts; torch-free: the planner's
`--model tiny-qwen3-moe` reads one before torch is imported). families.FAMILIES pairs each with
its family: `FAMILIES["qwen3_moe"].tiny_hf_config()` is `qwen3_moe()`."""
from __future__ import annotations

from typing import Any


def qwen3(**overrides: Any) -> dict[str, Any]:
    """A tiny Qwen3 config for tests: 4 layers (PP2 x VPP2), 4 heads / 2 kv heads (TP2)."""
    cfg = dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=False, attention_bias=False,
        initializer_range=0.02, torch_dtype="float32",
    )
    cfg.update(overrides)
    return cfg


def qwen3_moe(**overrides: Any) -> dict[str, Any]:
    """A tiny Qwen3-MoE config for tests: 4 layers, 4 experts top-2 (EP2), 4/2 heads (TP2)."""
    cfg = qwen3(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0,
        output_router_logits=False,
    )
    cfg.update(overrides)
    return cfg


def qwen2_moe(**overrides: Any) -> dict[str, Any]:
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


def glm4_moe(**overrides: Any) -> dict[str, Any]:
    """A tiny GLM-4.5-shaped config for tests: 4 layers (1 dense), 8 experts top-2 in 2 groups
    (1 chosen), routed_scaling_factor 2.5, one shared expert, QK-norm, q/k/v bias, half-rotary
    heads of 16 channels, 4/2 heads (TP2)."""
    cfg = dict(
        architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", vocab_size=512,
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, hidden_act="silu", max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=1000000.0, partial_rotary_factor=0.5,
        tie_word_embeddings=False, attention_bias=True, use_qk_norm=True, initializer_range=0.02,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, num_nextn_predict_layers=0, torch_dtype="float32",
    )
    cfg.update(overrides)
    return cfg


def deepseek_v3(**overrides: Any) -> dict[str, Any]:
    """A tiny DeepSeek-V3-shaped config for tests: 4 layers (1 dense), multi-latent attention with
    4 heads (TP2) of 12 + 8 rope channels for q and k and 16 for v, q through a rank-24 bottleneck,
    a rank-32 kv latent, YaRN x4 over an original context of 8 positions (32 in all) with mscale 1.0 /
    mscale_all_dim 0.8 (both of YaRN's factors differ from 1), then 8 experts top-2 in 2 groups (1
    chosen), routed_scaling_factor 2.5, one shared expert. Moonlight's shape (q_lora_rank null,
    plain RoPE, no groups, two shared experts) is `deepseek_v3(**MOONLIGHT)`."""
    cfg = dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=512,
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=12,
        qk_rope_head_dim=8, v_head_dim=16, hidden_act="silu", max_position_embeddings=32,
        rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                      "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1},
        tie_word_embeddings=False, attention_bias=False, initializer_range=0.02,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, num_nextn_predict_layers=0, torch_dtype="float32",
    )
    cfg.update(overrides)
    return cfg


def gpt_oss(**overrides: Any) -> dict[str, Any]:
    """A tiny gpt-oss-shaped config for tests: 4 layers alternating a sliding window of 8 tokens
    and full attention, 4 heads / 2 kv heads (TP2) of 16 channels with biases and sinks, YaRN x4
    over an original context of 8 positions (truncate false, as published), 8 experts top-4 (EP2)
    of width 32 with biases, and a SwiGLU clamp of 0.5 (published: 7.0), low enough that a tiny
    model's activations reach it."""
    cfg = dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=512, hidden_size=64,
        intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, hidden_act="silu", max_position_embeddings=32, rms_norm_eps=1e-5,
        rope_theta=150000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                      "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
        sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
        attention_bias=True, tie_word_embeddings=False, initializer_range=0.02,
        num_local_experts=8, num_experts_per_tok=4, swiglu_limit=0.5, router_aux_loss_coef=0.0,
        output_router_logits=False, torch_dtype="float32",
    )
    cfg.update(overrides)
    return cfg


def qwen3_next(**overrides: Any) -> dict[str, Any]:
    """A tiny Qwen3-Next-shaped config for tests: 4 layers, three Gated DeltaNet layers then one
    full-attention layer (full_attention_interval 4, as published); the DeltaNet with 2 key heads
    and 4 value heads (TP2) of 16 channels and a conv of width 4; full attention with 4/2 heads
    (TP2) of 16 channels, QK-norm, an output gate and a quarter of each head rotated; 4 experts
    top-2 (EP2) and a gated shared expert."""
    cfg = dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=512,
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, hidden_act="silu", max_position_embeddings=2048,
        rms_norm_eps=1e-6, rope_theta=1000000.0, partial_rotary_factor=0.25,
        full_attention_interval=4, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        tie_word_embeddings=False, attention_bias=False, initializer_range=0.02,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], router_aux_loss_coef=0.0, output_router_logits=False,
        torch_dtype="float32",
    )
    cfg.update(overrides)
    return cfg


MOONLIGHT = dict(q_lora_rank=None, rope_scaling=None, n_group=1, topk_group=1, n_shared_experts=2)
"""deepseek_v3's overrides for Moonlight-16B-A3B's (and DeepSeek-V2-Lite's) shape."""
