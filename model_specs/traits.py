"""The decoder families' traits: what distinguishes one family's HF config from another's.

Torch-free (plain data), so that the planner and the command line's early checks can tell a
model's family and shape without importing torch or megatron-core (shape.py). `FAMILY_TRAITS` is
the table of families, one row each with the architecture it describes in a comment above it;
families.py pairs each row with its tiny test config (tiny.py) and maps a config to its family.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from model_specs.hf.config import HFConfigError


@dataclass(frozen=True)
class FamilyTraits:
    """What distinguishes one decoder family's HF config from another's."""

    name: str
    """The family's name (FAMILIES key)."""
    model_types: tuple[str, ...]
    """HF `model_type` values of the family."""
    qk_layernorm: bool = False
    """Always QK-norm (RMSNorm over each head's q and k before RoPE)."""
    qk_norm_field: str | None = None
    """A config field that turns QK-norm on (GLM-4.5: use_qk_norm)."""
    qkv_bias: bool = False
    """q/k/v have a bias unless the config says `qkv_bias: false` (Qwen2-MoE spells it so);
    `attention_bias: true` also turns it on."""
    moe: bool = False
    """Routed experts (moe.py)."""
    router: str = "softmax"
    """MoE router: "softmax" (Qwen) or "sigmoid" (GLM-4.5: expert bias, groups, scaling)."""
    shared_expert: str | None = None
    """None, "gated" (Qwen2-MoE) or "plain" (GLM-4.5); see moe.py."""
    partial_rotary: bool = False
    """The HF class rotates only `partial_rotary_factor` of each head (GLM-4.5)."""
    attention: str = "gqa"
    """"gqa": q, k and v projections of the hidden state (megatron's fused linear_qkv);
    "mla": DeepSeek's multi-latent attention (mla_fields.py, mla.py); "gqa_sinks": gpt-oss's
    GQA with learnable attention sinks, sliding-window layers and a bias on every linear layer
    (gpt_oss_fields.py, sinks.py); "gdn_hybrid": Qwen3-Next's Gated DeltaNet layers between
    gated GQA layers (gdn_fields.py)."""
    experts: str = "per_expert"
    """How HF stores a layer's routed experts: "per_expert" (`mlp.experts.{e}.gate_proj` ... and
    the router as `mlp.gate`), or "stacked" (gpt-oss: `mlp.experts.gate_up_proj` [E, h, 2 x ffn]
    with gate and up interleaved, `down_proj` [E, ffn, h], their biases, and `mlp.router`)."""
    expert_size_field: str = "moe_intermediate_size"
    """The HF field of one routed expert's ffn width (gpt-oss: intermediate_size)."""


FAMILY_TRAITS: dict[str, FamilyTraits] = {t.name: t for t in (
    # Qwen3 (dense): GQA, QK-norm (RMSNorm on each head's q and k), no qkv bias, RoPE.
    FamilyTraits(name="qwen3", model_types=("qwen3",), qk_layernorm=True),
    # Qwen3-MoE: Qwen3 attention (GQA, QK-norm) + routed experts (softmax router, top-k,
    # norm_topk_prob), no shared expert; `mlp_only_layers` / `decoder_sparse_step` pick dense layers.
    FamilyTraits(name="qwen3_moe", model_types=("qwen3_moe",), qk_layernorm=True, moe=True),
    # Qwen2 (dense): GQA with a bias on q/k/v (no other biases), no QK-norm, RoPE.
    FamilyTraits(name="qwen2", model_types=("qwen2",), qkv_bias=True),
    # Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (GQA, q/k/v bias, no QK-norm) +
    # routed experts (softmax router, top-k, norm_topk_prob) + one shared expert scaled by
    # sigmoid(shared_expert_gate(x)); `mlp_only_layers` / `decoder_sparse_step` pick dense layers.
    FamilyTraits(name="qwen2_moe", model_types=("qwen2_moe",), qkv_bias=True, moe=True,
                 router="softmax", shared_expert="gated"),
    # GLM-4.5 / GLM-4.6 / GLM-4.5-Air (Glm4MoeForCausalLM): GQA with q/k/v bias, optional QK-norm
    # (`use_qk_norm`), partial RoPE (`partial_rotary_factor`, the first half of each head rotated),
    # the first `first_k_dense_replace` layers dense, then MoE layers with a sigmoid router whose
    # expert bias (`e_score_correction_bias`) enters only the choice of experts, group-limited
    # top-k (`n_group` / `topk_group`), `routed_scaling_factor`, and `n_shared_experts` ungated
    # shared experts.
    # The multi-token-prediction layers of the published checkpoints (`num_nextn_predict_layers`,
    # `model.layers.{num_hidden_layers}.*`) are not part of the model: transformers ignores them
    # when loading (modeling_glm4_moe.py, _keys_to_ignore_on_load_unexpected), so does this
    # mapping (weight_maps.WeightMap.ignores_hf).
    FamilyTraits(name="glm4_moe", model_types=("glm4_moe",), qk_norm_field="use_qk_norm",
                 moe=True, router="sigmoid", shared_expert="plain", partial_rotary=True),
    # DeepSeek-V3 / Kimi-K2 / Moonlight (DeepseekV3ForCausalLM; Kimi-K2's config says
    # model_type kimi_k2): multi-latent attention (q through a q_lora_rank bottleneck with an
    # RMSNorm, or one q_proj when q_lora_rank is null as in Moonlight; k and v from one
    # kv_lora_rank latent with an RMSNorm; the last qk_rope_head_dim channels of q and k rotated in
    # interleaved pairs, k's shared by every head), plain RoPE or YaRN with DeepSeek's mscale, then
    # GLM-4.5's MoE: the first `first_k_dense_replace` layers dense, a sigmoid router with the
    # expert bias and group-limited top-k, `routed_scaling_factor`, `n_shared_experts` ungated
    # shared experts. The multi-token-prediction layers are left out as GLM-4.5's are.
    FamilyTraits(name="deepseek_v3", model_types=("deepseek_v3", "kimi_k2"), moe=True,
                 router="sigmoid", shared_expert="plain", attention="mla"),
    # gpt-oss (GptOssForCausalLM): GQA (head_dim 64) with a bias on q/k/v/o, one learnable
    # attention sink per head (a logit added to each softmax's denominator), sliding-window
    # attention on the layers `layer_types` names (alternate ones), YaRN; every layer MoE: a
    # router with a bias, top-k then softmax over the k logits, experts with biases and a clamped
    # SwiGLU, (up + 1) * gate * sigmoid(1.702 gate) (gate clamped above, up both sides at
    # swiglu_limit); experts stacked per layer in the HF files, MXFP4 in the published ones
    # (dequantized by the converter: gspo_megatron/checkpoint/mxfp4.py).
    FamilyTraits(name="gpt_oss", model_types=("gpt_oss",), moe=True, attention="gqa_sinks",
                 experts="stacked", expert_size_field="intermediate_size"),
    # Qwen3-Next (Qwen3NextForCausalLM): three Gated DeltaNet (linear attention) layers to one
    # full-attention layer, that one GQA with QK-norm, partial RoPE and a sigmoid output gate;
    # zero-centred RMSNorms; Qwen2-MoE's MoE block (softmax router, a gated shared expert) on every
    # layer. The multi-token-prediction weights of the published checkpoints (`mtp.*`) are not
    # part of the model (transformers ignores them when loading). gdn_fields.py has the rest.
    FamilyTraits(name="qwen3_next", model_types=("qwen3_next",), qk_layernorm=True, moe=True,
                 router="softmax", shared_expert="gated", partial_rotary=True,
                 attention="gdn_hybrid"),
    # Llama (dense): GQA, no biases (attention_bias / mlp_bias must be false; mlp_bias=true is
    # refused by shape.shape_fields), RoPE without scaling.
    FamilyTraits(name="llama", model_types=("llama",)),
)}
_BY_MODEL_TYPE = {m: t for t in FAMILY_TRAITS.values() for m in t.model_types}


def traits_for(hf_config: Mapping[str, Any]) -> FamilyTraits:
    """The traits of a normalised HF config's family; an unknown model_type is refused by name."""
    model_type = hf_config.get("model_type")
    if model_type not in _BY_MODEL_TYPE:
        raise HFConfigError(f"unknown architecture: model_type={model_type!r} "
                            f"(architectures={hf_config.get('architectures')}) is not a supported "
                            f"family; supported: {sorted(_BY_MODEL_TYPE)}")
    return _BY_MODEL_TYPE[model_type]


def attention_options(traits: FamilyTraits, hf: Mapping[str, Any]) -> tuple[bool, bool]:
    """(QK-norm, q/k/v bias) of a config of this family; the weight map reads the same. MLA has
    neither (its q/kv norms are the latents', and a bias is refused: mla_fields.py)."""
    if traits.attention == "mla":
        return False, False
    if traits.attention == "gqa_sinks":
        return False, True  # attention_bias=false is refused (gpt_oss_fields.py)
    qk_norm = traits.qk_layernorm or bool(traits.qk_norm_field and hf.get(traits.qk_norm_field))
    qkv_bias = bool(hf.get("qkv_bias", traits.qkv_bias)) or bool(hf.get("attention_bias", False))
    return qk_norm, qkv_bias
