"""HF config.json -> megatron-core TransformerConfig + layer spec, shared by the decoder families.

A family module (qwen3, qwen3_moe, qwen2, llama) declares only what differs (`FamilyTraits`);
`build_model_spec` does the mapping. The actor builds a GPTModel from the returned `ModelSpec`
without knowing which family or backend (TE or local) it came from. This package knows HF and
megatron-core only: the parallel layout and the machine's adaptations arrive as TransformerConfig
`overrides` from the caller.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from model_specs.hf_config import HFConfigError, moe_layer_pattern, require
from model_specs.norms import HAVE_TE, replace_local_norms, te_checkpoint_keys


@dataclass(frozen=True)
class FamilyTraits:
    """What distinguishes one decoder family's HF config from another's."""

    name: str
    model_types: tuple[str, ...]
    qk_layernorm: bool = False
    qkv_bias: bool = False
    moe: bool = False


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
            position_embedding_type="rope",
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
    if hf.get("model_type") not in traits.model_types:
        raise HFConfigError(f"model_type {hf.get('model_type')!r} is not a {fam} model "
                            f"(expected one of {traits.model_types})")
    if hf.get("rope_scaling"):
        raise HFConfigError(f"{fam}: rope_scaling={hf['rope_scaling']} is not supported yet")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFConfigError(f"{fam}: hidden_act={hf['hidden_act']!r}, expected 'silu'")
    use_te = HAVE_TE if transformer_engine is None else bool(transformer_engine)
    if use_te and not HAVE_TE:
        raise HFConfigError("transformer_engine=True, but Transformer Engine does not import here "
                            "(it needs CUDA and cuDNN)")
    num_layers = int(require(hf, "num_hidden_layers", fam))
    hidden = int(require(hf, "hidden_size", fam))
    heads = int(require(hf, "num_attention_heads", fam))
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or hidden // heads)
    vocab = int(require(hf, "vocab_size", fam))

    kwargs: dict[str, Any] = dict(
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_hidden_size=int(require(hf, "intermediate_size", fam)),
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=traits.qkv_bias or bool(hf.get("attention_bias", False)),
        qk_layernorm=traits.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        init_method_std=float(hf.get("initializer_range", 0.02)),
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
    )
    if traits.moe:
        kwargs.update(
            num_moe_experts=int(require(hf, "num_experts", fam)),
            moe_router_topk=int(require(hf, "num_experts_per_tok", fam)),
            moe_ffn_hidden_size=int(require(hf, "moe_intermediate_size", fam)),
            moe_layer_freq=moe_layer_pattern(hf, num_layers),
            moe_router_score_function="softmax",
            # norm_topk_prob=True (Qwen3-MoE): softmax over all experts, top-k, renormalise, which
            # equals megatron's top-k-then-softmax. False: keep the full-softmax probabilities.
            moe_router_pre_softmax=not bool(hf.get("norm_topk_prob", True)),
            # RL fine-tuning: no load-balancing loss by default (it would enter the GSPO gradient).
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
        )
    kwargs.update(overrides or {})
    unknown = set(kwargs) - {f.name for f in dataclasses.fields(TransformerConfig)}
    if unknown:
        raise HFConfigError(f"unknown TransformerConfig fields in overrides: {sorted(unknown)}")
    config = TransformerConfig(**kwargs)

    def layer_spec_fn(vp_stage: int | None, pp_rank: int | None) -> TransformerBlockSubmodules:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                          normalization="RMSNorm", vp_stage=vp_stage,
                                          pp_rank=pp_rank)
        return spec if use_te else te_checkpoint_keys(replace_local_norms(spec))

    return ModelSpec(
        family=fam,
        hf_config=hf,
        config=config,
        vocab_size=vocab,
        max_sequence_length=int(hf.get("max_position_embeddings", 4096)),
        rotary_base=float(hf.get("rope_theta", 10000.0)),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        layer_spec_fn=layer_spec_fn,
        transformer_engine=use_te,
    )
