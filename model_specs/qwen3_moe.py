"""Qwen3-MoE: Qwen3 attention (GQA, QK-norm) + routed experts (softmax router, top-k,
norm_topk_prob), no shared expert; `mlp_only_layers` / `decoder_sparse_step` pick dense layers."""
from __future__ import annotations

from typing import Any, Mapping

from model_specs.common import FamilyTraits, ModelSpec, build_model_spec
from model_specs.qwen3 import tiny_hf_config as tiny_dense_config

TRAITS = FamilyTraits(name="qwen3_moe", model_types=("qwen3_moe",), qk_layernorm=True, moe=True)


def model_spec(hf_config: Mapping[str, Any], **kwargs: Any) -> ModelSpec:
    """See common.build_model_spec (params_dtype, overrides, transformer_engine)."""
    return build_model_spec(TRAITS, hf_config, **kwargs)


def tiny_hf_config(**overrides: Any) -> dict[str, Any]:
    """A tiny Qwen3-MoE config for tests: 4 layers, 4 experts top-2 (EP2), 4/2 heads (TP2)."""
    cfg = tiny_dense_config(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0,
        output_router_logits=False,
    )
    cfg.update(overrides)
    return cfg
