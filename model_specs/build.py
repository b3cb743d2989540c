"""HF config.json -> megatron-core TransformerConfig + layer spec: a family's features, in turn.

    spec = model_spec_for("/models/Qwen3-30B-A3B", overrides={"tensor_model_parallel_size": 2})
    model = GPTModel(spec.config, spec.block_spec(vp_stage), **spec.gpt_model_kwargs(), ...)

What differs between the decoder families is their list of features (families/); each feature
(features/) maps its HF fields, forces or refuses what it must under the caller's settings, and
puts its modules in megatron's layer spec. The actor builds a GPTModel from the returned
`ModelSpec` without knowing which family or backend (TE or local) it came from. This package
knows HF and megatron-core only: the parallel layout and the machine's adaptations arrive as
TransformerConfig `overrides` from the caller.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from model_specs.families import Family, family_for
from model_specs.features import BuildContext, LayerContext
from model_specs.hf.config import HFConfigError, load_hf_config, require
from model_specs.norms import HAVE_TE, replace_local_norms, te_checkpoint_keys
from model_specs.shape import model_fields


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
    """GPTModel position_embedding_type: "rope", or "yarn" (features/rope/)."""
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


def build_model_spec(family: Family, hf: Mapping[str, Any], *,
                     params_dtype: torch.dtype = torch.float32,
                     overrides: Mapping[str, Any] | None = None,
                     transformer_engine: bool | None = None) -> ModelSpec:
    """Map an HF config to a TransformerConfig; `overrides` win over the mapping.

    The mapping describes the model only. How it is split (tensor/pipeline/expert sizes, sequence
    parallelism) and how it runs on this machine (CPU adaptations, GPU fusions) are the caller's
    TransformerConfig fields, passed as `overrides` (the actor's layout and device settings).
    transformer_engine: build the TE layer spec (True) or the local one (False); None = TE when it
    imports and CUDA is present, and no feature refuses it.
    """
    hf = dict(hf)
    fam, features = family.name, family.all_features
    draft = model_fields(family, hf)  # refuses what cannot be mapped, by name
    local_only = [f.local_spec_only for f in features if f.local_spec_only]
    if local_only and transformer_engine:
        raise HFConfigError(f"{fam}: {local_only[0]}; set compute.transformer_engine: false (the "
                            "local spec)")
    use_te = HAVE_TE and not local_only if transformer_engine is None else bool(transformer_engine)
    if use_te and not HAVE_TE:
        raise HFConfigError("transformer_engine=True, but Transformer Engine does not import here "
                            "(it needs CUDA and cuDNN)")
    vocab = int(require(hf, "vocab_size", fam))
    build = BuildContext(fam, params_dtype, use_te)
    kwargs = dict(draft.config)
    for feature in features:
        feature.config_fields(kwargs, build)
    kwargs.update(overrides or {})
    for feature in features:
        feature.settle(kwargs, build)
    classes = {c for c in (f.config_class(draft) for f in features) if c is not None}
    if len(classes) > 1:
        raise ValueError(f"{fam}: its features need {len(classes)} TransformerConfig classes "
                         f"({sorted(c.__name__ for c in classes)}), a config has one")
    config_class = classes.pop() if classes else TransformerConfig
    unknown = set(kwargs) - {f.name for f in dataclasses.fields(config_class)}
    if unknown:
        raise HFConfigError(f"unknown TransformerConfig fields in overrides: {sorted(unknown)}")
    config = config_class(**kwargs)

    def layer_spec_fn(vp_stage: int | None, pp_rank: int | None) -> TransformerBlockSubmodules:
        base = config
        for feature in features:
            base = feature.block_config(base)
        spec = get_gpt_decoder_block_spec(base, use_transformer_engine=use_te,
                                          normalization="RMSNorm", vp_stage=vp_stage,
                                          pp_rank=pp_rank)
        layer = LayerContext(config, use_te, vp_stage, pp_rank)
        for feature in features:
            spec = feature.layer_spec(spec, layer)
        return spec if use_te else te_checkpoint_keys(replace_local_norms(spec))

    rope = draft.gpt_model
    return ModelSpec(
        family=fam,
        hf_config=hf,
        config=config,
        vocab_size=vocab,
        max_sequence_length=int(hf.get("max_position_embeddings", 4096)),
        rotary_base=rope["rotary_base"],
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        layer_spec_fn=layer_spec_fn,
        transformer_engine=use_te,
        position_embedding_type=rope["position_embedding_type"],
        rotary_percent=rope["rotary_percent"],
    )


def model_spec_for(source: str | Path | Mapping[str, Any], *,
                   params_dtype: torch.dtype = torch.float32,
                   overrides: Mapping[str, Any] | None = None,
                   transformer_engine: bool | None = None) -> ModelSpec:
    """The ModelSpec of an HF model (dict, config.json or model directory); see
    build_model_spec for `overrides` and `transformer_engine`."""
    hf = load_hf_config(source)
    return build_model_spec(family_for(hf), hf, params_dtype=params_dtype, overrides=overrides,
                            transformer_engine=transformer_engine)
