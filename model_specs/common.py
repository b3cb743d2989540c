"""HF config.json -> megatron-core TransformerConfig + layer spec, shared by the decoder families.

A family module (qwen3, qwen3_moe, qwen2, llama) declares only what differs (`FamilyTraits`);
`build_model_spec` does the mapping. The actor builds a GPTModel from the returned `ModelSpec`
without knowing which family or backend (TE or local) it came from.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from gspo_megatron.parallel.cpu_compat import cpu_config_overrides
from gspo_megatron.parallel.layout import ParallelLayout
from model_specs.norms import HAVE_TE, replace_local_norms


class ConfigError(ValueError):
    """An HF config.json that this project cannot map; the message names the field."""


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


def load_hf_config(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A config dict from a dict, a config.json path, or an HF model directory."""
    from model_specs.weight_maps import normalize_hf_config

    if isinstance(source, Mapping):
        return normalize_hf_config(dict(source))
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no HF config.json at {path}")
    try:
        return normalize_hf_config(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


def _require(hf: Mapping[str, Any], key: str, family: str) -> Any:
    if key not in hf or hf[key] is None:
        raise ConfigError(f"{family} config.json lacks required field '{key}'")
    return hf[key]


def _moe_layer_pattern(hf: Mapping[str, Any], num_layers: int) -> list[int]:
    """Qwen3-MoE: layer i is sparse unless listed in mlp_only_layers or off the sparse step."""
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    return [0 if (i in dense or (i + 1) % step) else 1 for i in range(num_layers)]


def build_model_spec(traits: FamilyTraits, hf: Mapping[str, Any], layout: ParallelLayout, *,
                     params_dtype: torch.dtype = torch.float32,
                     overrides: Mapping[str, Any] | None = None) -> ModelSpec:
    """Map an HF config to a TransformerConfig for `layout`; `overrides` win over the mapping."""
    hf = dict(hf)
    fam = traits.name
    if hf.get("model_type") not in traits.model_types:
        raise ConfigError(f"model_type {hf.get('model_type')!r} is not a {fam} model "
                          f"(expected one of {traits.model_types})")
    if hf.get("rope_scaling"):
        raise ConfigError(f"{fam}: rope_scaling={hf['rope_scaling']} is not supported yet")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{fam}: hidden_act={hf['hidden_act']!r}, expected 'silu'")
    num_layers = int(_require(hf, "num_hidden_layers", fam))
    hidden = int(_require(hf, "hidden_size", fam))
    heads = int(_require(hf, "num_attention_heads", fam))
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or hidden // heads)
    vocab = int(_require(hf, "vocab_size", fam))
    num_experts = int(_require(hf, "num_experts", fam)) if traits.moe else None
    layout.validate(_world_size_hint(layout), num_layers=num_layers, num_attention_heads=heads,
                    num_query_groups=kv_heads, vocab_size=vocab, num_experts=num_experts)

    kwargs: dict[str, Any] = dict(
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_hidden_size=int(_require(hf, "intermediate_size", fam)),
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
        tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        expert_model_parallel_size=layout.expert,
        expert_tensor_parallel_size=layout.etp,
        sequence_parallel=layout.use_sequence_parallel(traits.moe),
        # Per-micro-batch sequence lengths differ in RL: PP stages exchange shapes first.
        variable_seq_lengths=layout.pipeline > 1,
        # Also for dense models: TransformerConfig rejects variable_seq_lengths with the default
        # allgather dispatcher even when there are no experts.
        moe_token_dispatcher_type="alltoall",
    )
    if traits.moe:
        kwargs.update(
            num_moe_experts=num_experts,
            moe_router_topk=int(_require(hf, "num_experts_per_tok", fam)),
            moe_ffn_hidden_size=int(_require(hf, "moe_intermediate_size", fam)),
            moe_layer_freq=_moe_layer_pattern(hf, num_layers),
            moe_router_score_function="softmax",
            # norm_topk_prob=True (Qwen3-MoE): softmax over all experts, top-k, renormalise, which
            # equals megatron's top-k-then-softmax. False: keep the full-softmax probabilities.
            moe_router_pre_softmax=not bool(hf.get("norm_topk_prob", True)),
            # RL fine-tuning: no load-balancing loss by default (it would enter the GSPO gradient).
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
        )
    if not torch.cuda.is_available():
        kwargs.update(cpu_config_overrides(layout.vpp))
    kwargs.update(overrides or {})
    unknown = set(kwargs) - {f.name for f in dataclasses.fields(TransformerConfig)}
    if unknown:
        raise ConfigError(f"unknown TransformerConfig fields in overrides: {sorted(unknown)}")
    config = TransformerConfig(**kwargs)

    def layer_spec_fn(vp_stage: int | None, pp_rank: int | None) -> TransformerBlockSubmodules:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=HAVE_TE,
                                          normalization="RMSNorm", vp_stage=vp_stage,
                                          pp_rank=pp_rank)
        return spec if HAVE_TE else replace_local_norms(spec)

    return ModelSpec(
        family=fam,
        hf_config=hf,
        config=config,
        vocab_size=vocab,
        max_sequence_length=int(hf.get("max_position_embeddings", 4096)),
        rotary_base=float(hf.get("rope_theta", 10000.0)),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        layer_spec_fn=layer_spec_fn,
    )


def _world_size_hint(layout: ParallelLayout) -> int:
    """World size for validation: the real one if torch.distributed is up, else the minimum."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_world_size()
    import math

    return math.lcm(layout.tensor * layout.pipeline, layout.etp * layout.expert * layout.pipeline)


