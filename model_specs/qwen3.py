"""Qwen3 (dense): GQA, QK-norm (RMSNorm on each head's q and k), no qkv bias, RoPE."""
from __future__ import annotations

from typing import Any, Mapping

from model_specs.common import FamilyTraits, ModelSpec, build_model_spec

TRAITS = FamilyTraits(name="qwen3", model_types=("qwen3",), qk_layernorm=True)


def model_spec(hf_config: Mapping[str, Any], **kwargs: Any) -> ModelSpec:
    """See common.build_model_spec (params_dtype, overrides, transformer_engine)."""
    return build_model_spec(TRAITS, hf_config, **kwargs)


def tiny_hf_config(**overrides: Any) -> dict[str, Any]:
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
