"""HF config.json -> megatron-core TransformerConfig + layer spec, shared by the decoder families.

What differs between the decoder families (qwen3, qwen3_moe, qwen2, qwen2_moe, glm4_moe,
deepseek_v3, gpt_oss, llama) is their `FamilyTraits` (traits.py); `build_model_spec` does the mapping, from
shape.py's fields (the torch-free shape, MoE fields from moe_fields.py, multi-latent attention's
from mla_fields.py), with rope.py (RoPE / YaRN), moe.py (the expert-bias router) and mla.py
(megatron's multi-latent attention as transformers computes it) and sinks.py (gpt-oss's attention
sinks, sliding windows, biases and clamped SwiGLU). The actor builds a GPTModel from
the returned `ModelSpec` without knowing which family or backend (TE or local) it came from. This
package knows HF and megatron-core only: the parallel layout and the machine's adaptations arrive as
TransformerConfig `overrides` from the caller.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from megatron.core.activations import quick_gelu
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import MLATransformerConfig

from model_specs.gdn import use_gated_delta_net
from model_specs.hf.config import HFConfigError, require
from model_specs.mla import adapt_mla_spec
from model_specs.moe import use_expert_bias_router, use_expert_fc2
from model_specs.norms import HAVE_TE, replace_local_norms, te_checkpoint_keys
from model_specs.rope import RopeMapping, rope_mapping
from model_specs.shape import shape_fields
from model_specs.sinks import use_sink_attention
from model_specs.traits import FamilyTraits


@dataclass
class YarnTransformerConfig(TransformerConfig):
    """TransformerConfig + the yarn_* attributes GPTModel reads with getattr when
    position_embedding_type="yarn" (gpt_model.py:172-190; megatron-core 0.16.1 and 0.19.2 declare
    them on no config class of the GPT path)."""

    yarn_rotary_scaling_factor: float = 1.0
    """HF rope_scaling.factor: the context extension factor (interpolation divides by it)."""
    yarn_original_max_position_embeddings: int = 4096
    """HF rope_scaling.original_max_position_embeddings: the pretraining context length."""
    yarn_beta_fast: float = 32.0
    """HF rope_scaling.beta_fast: rotations above which a dimension is extrapolated."""
    yarn_beta_slow: float = 1.0
    """HF rope_scaling.beta_slow: rotations below which a dimension is interpolated."""
    yarn_mscale: float = 1.0
    """Kept at 1 together with yarn_mscale_all_dim (megatron's concentration factor = 1); the
    attention factor is applied through softmax_scale (module docstring)."""
    yarn_mscale_all_dim: float = 1.0
    """See yarn_mscale."""
    yarn_correction_range_round_to_int: bool = True
    """HF rope_scaling.truncate: round the ramp's bounds to integers."""


@dataclass
class ModelSpec:
    """Everything the actor needs to build a megatron GPTModel for one HF model."""

    family: str
    hf_config: dict[str, Any]
    config: TransformerConfig
    vocab_size: int
    max_sequence_length: int
    rotary_base: float
    share_embeddings_and_output_weights: bool
    layer_spec_fn: Callable[[int | None, int | None], TransformerBlockSubmodules] = field(repr=False)
    transformer_engine: bool = False
    """The layer spec is Transformer Engine's (True) or megatron's local one (False)."""
    position_embedding_type: str = "rope"
    """GPTModel position_embedding_type: "rope", or "yarn" (rope.py)."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that RoPE rotates (HF partial_rotary_factor)."""

    @property
    def is_moe(self) -> bool:
        return bool(self.config.num_moe_experts)

    def block_spec(self, vp_stage: int | None = None,
                   pp_rank: int | None = None) -> TransformerBlockSubmodules:
        """The layers of one (virtual) pipeline stage; pp_rank defaults to this rank's."""
        return self.layer_spec_fn(vp_stage, pp_rank)

    def gpt_model_kwargs(self) -> dict[str, Any]:
        return dict(
            vocab_size=self.vocab_size,
            max_sequence_length=self.max_sequence_length,
            position_embedding_type=self.position_embedding_type,
            rotary_percent=self.rotary_percent,
            rotary_base=self.rotary_base,
            share_embeddings_and_output_weights=self.share_embeddings_and_output_weights,
        )


def build_model_spec(traits: FamilyTraits, hf: Mapping[str, Any], *,
                     params_dtype: torch.dtype = torch.float32,
                     overrides: Mapping[str, Any] | None = None,
                     transformer_engine: bool | None = None) -> ModelSpec:
    """Map an HF config to a TransformerConfig; `overrides` win over the mapping.

    The mapping describes the model only. How it is split (tensor/pipeline/expert sizes, sequence
    parallelism) and how it runs on this machine (CPU adaptations, GPU fusions) are the caller's
    TransformerConfig fields, passed as `overrides` (the actor's layout and device settings).
    transformer_engine: build the TE layer spec (True) or the local one (False); None = TE when it
    imports and CUDA is present.
    """
    hf = dict(hf)
    fam = traits.name
    kwargs: dict[str, Any] = shape_fields(traits, hf)  # refuses what cannot be mapped, by name
    sinks = kwargs.get("softmax_type", "vanilla") != "vanilla"
    if sinks and transformer_engine:
        raise HFConfigError(f"{fam}: attention sinks with Transformer Engine's layer spec are not "
                            "supported: TE keeps the sinks inside its attention, where no test of "
                            "this project has checked their split over TP ranks (model_specs/"
                            "sinks.py); set compute.transformer_engine: false (the local spec)")
    use_te = HAVE_TE and not sinks if transformer_engine is None else bool(transformer_engine)
    if use_te and not HAVE_TE:
        raise HFConfigError("transformer_engine=True, but Transformer Engine does not import here "
                            "(it needs CUDA and cuDNN)")
    vocab = int(require(hf, "vocab_size", fam))
    mla = bool(kwargs.get("multi_latent_attention"))
    # MLA applies its own RoPE / YaRN (mla_fields.py); GPTModel builds none for it with "rope".
    rope = RopeMapping("rope", 1.0, kwargs["rotary_base"]) if mla else \
        rope_mapping(hf, fam, kwargs["kv_channels"], traits.partial_rotary)
    kwargs.update(
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        # gpt-oss's clamped SwiGLU: quick_gelu with an offset and a clamp (model_specs/sinks.py)
        activation_func=quick_gelu if kwargs.get("activation_func_clamp_value") else F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        init_method_std=float(hf.get("initializer_range", 0.02)),
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
    )
    kwargs.update(rope.config_fields)
    kwargs.update(overrides or {})
    if mla:
        # megatron refuses rope fusion for MLA's plain RoPE and calls it experimental for its
        # YaRN (transformer_config.py, MLATransformerConfig and __post_init__); the unfused path
        # is the one whose log-probs the tests hold to transformers'.
        kwargs["apply_rope_fusion"] = False
        if kwargs.get("tensor_model_parallel_size", 1) > 1 and not kwargs.get("sequence_parallel"):
            raise HFConfigError(f"{fam}: multi-latent attention with tensor parallelism needs "
                                "sequence parallelism (parallel.sequence_parallel: true or unset): "
                                "without it each rank keeps only its heads' share of the shared "
                                "rope key's gradient (model_specs/mla.py)")
    if kwargs.get("activation_func_clamp_value") is not None:
        # gpt-oss's clamped SwiGLU runs unfused: megatron's fused bias-activation path takes
        # quick_gelu only with per-token scales (mlp.py:171-206, "Only support fusion of gelu and
        # swiglu" otherwise), and TransformerConfig refuses the fusion for activations.quick_gelu
        # (transformer_config.py:1485, which compares with fused_bias_geglu.quick_gelu); the CUDA
        # defaults turn the fusion on (actor/settings.py)
        kwargs["bias_activation_fusion"] = False
    gdn = kwargs.get("experimental_attention_variant") == "gated_delta_net"
    if gdn and not torch.cuda.is_available():
        # the torch forms of the DeltaNet's kernels (model_specs/gdn.py): megatron's torch
        # convolution and chunked delta rule are the ones deterministic_mode selects
        kwargs["deterministic_mode"] = True
    if gdn and kwargs.get("context_parallel_size", 1) > 1:
        raise HFConfigError(f"{fam}: context parallelism with Gated DeltaNet layers is not "
                            "supported (megatron-core 0.16.1's layer has none: gated_delta_net.py)")
    config_class = MLATransformerConfig if mla else \
        YarnTransformerConfig if rope.position_embedding_type == "yarn" else TransformerConfig
    unknown = set(kwargs) - {f.name for f in dataclasses.fields(config_class)}
    if unknown:
        raise HFConfigError(f"unknown TransformerConfig fields in overrides: {sorted(unknown)}")
    etp = kwargs.get("expert_tensor_parallel_size") or kwargs.get("tensor_model_parallel_size", 1)
    if kwargs.get("num_moe_experts") and kwargs.get("add_bias_linear") and etp > 1:
        # megatron asserts it too (transformer_config.py:1590), without naming the way out
        raise HFConfigError(f"{fam}: expert_tensor_parallel_size={etp} with expert biases is not "
                            "supported: each expert-TP rank adds the fc2 bias to its partial sum "
                            "before the sums are reduced (megatron-core mlp.py:247, "
                            "tensor_parallel/layers.py:1286), so it would count once per rank; "
                            "set parallel.expert_tensor: 1")
    config = config_class(**kwargs)
    expert_bias = bool(config.moe_router_enable_expert_bias)

    def layer_spec_fn(vp_stage: int | None, pp_rank: int | None) -> TransformerBlockSubmodules:
        # megatron-core 0.19 refuses the variant in its GPT spec (gpt_layer_specs.py:572): the
        # block's layers come from the config without it, and gdn.py puts the DeltaNet in
        base = dataclasses.replace(config, experimental_attention_variant=None,
                                   linear_attention_freq=None) if gdn else config
        spec = get_gpt_decoder_block_spec(base, use_transformer_engine=use_te,
                                          normalization="RMSNorm", vp_stage=vp_stage,
                                          pp_rank=pp_rank)
        if gdn:
            spec = use_gated_delta_net(spec, config, use_te, vp_stage, pp_rank)
        if expert_bias:
            spec = use_expert_bias_router(spec)
        if mla:
            spec = adapt_mla_spec(spec, local=not use_te, plain_q_proj=config.q_lora_rank is None)
        if sinks:
            spec = use_sink_attention(spec)
        if config.num_moe_experts and config.add_bias_linear and not use_te:
            spec = use_expert_fc2(spec)  # expert biases on one expert-TP rank (moe.py)
        return spec if use_te else te_checkpoint_keys(replace_local_norms(spec))

    return ModelSpec(
        family=fam,
        hf_config=hf,
        config=config,
        vocab_size=vocab,
        max_sequence_length=int(hf.get("max_position_embeddings", 4096)),
        rotary_base=rope.rotary_base,
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        layer_spec_fn=layer_spec_fn,
        transformer_engine=use_te,
        position_embedding_type=rope.position_embedding_type,
        rotary_percent=rope.rotary_percent,
    )
