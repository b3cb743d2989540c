"""Qwen3-Next's Gated DeltaNet layers (the `GatedDeltaNet` feature). Its TransformerConfig fields
are plain numbers, torch-free, so that shape.py (the planner) and param_count read the same
mapping as a built model; the megatron-core layers: layers.py.

Qwen3-Next (Qwen3NextForCausalLM) has two kinds of token mixer, named per layer by `layer_types`
(transformers' default: every `full_attention_interval`-th layer full attention, the others
linear):
- "linear_attention": a Gated DeltaNet (megatron-core's `experimental_attention_variant=
  "gated_delta_net"`, megatron/core/ssm/gated_delta_net.py): one projection of the hidden state
  to q, k (linear_num_key_heads x linear_key_head_dim), v and an output gate z
  (linear_num_value_heads x linear_value_head_dim), and per value head beta and alpha; a
  depthwise causal convolution over q, k, v (linear_conv_kernel_dim); the gated delta rule; a
  gated RMSNorm; the output projection.
- "full_attention": GQA with QK-norm, partial RoPE (partial_rotary_factor of each head) and an
  output gate: q_proj also yields one gate per channel, and the attention's output is multiplied
  by its sigmoid before o_proj (megatron-core's `attention_output_gate`: attention.GatedAttention).
Every RMSNorm outside the DeltaNet's is zero-centred (zero_centered_norms.py).

    fields = gdn_fields(hf, "qwen3_next", num_layers=48)
    fields["linear_attention_freq"][:4]      # [1, 1, 1, 0]: megatron's pattern, 1 = linear
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from model_specs.features import BuildContext, Draft, Feature, LayerContext
from model_specs.hf.config import HFConfigError, require
from model_specs.weights.rules import COPY, GDN_IN_PROJ, H, L, WeightRule, restricted

LAYER_TYPES = ("linear_attention", "full_attention")


def layer_types(hf: Mapping[str, Any], num_layers: int) -> list[str]:
    """The config's layer_types, or transformers' default from full_attention_interval
    (configuration_qwen3_next.py: layer i is full attention when (i + 1) % interval == 0)."""
    types = hf.get("layer_types")
    if types is None:
        interval = int(hf.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(num_layers)]
    return list(types)


def gdn_fields(hf: Mapping[str, Any], family: str, num_layers: int) -> dict[str, Any]:
    """The Gated DeltaNet's TransformerConfig fields; what megatron-core would compute differently
    is refused by the field's name."""
    types = layer_types(hf, num_layers)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown or len(types) != num_layers:
        raise HFConfigError(f"{family}: layer_types={types} is not supported: expected "
                            f"{num_layers} entries, each one of {LAYER_TYPES}")
    if hf.get("attention_bias"):
        raise HFConfigError(f"{family}: attention_bias=true is not supported (Qwen3-Next's "
                            "projections have no bias; megatron's Gated DeltaNet takes none)")
    dims = {k: int(require(hf, k, family)) for k in (
        "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
        "linear_num_key_heads", "linear_num_value_heads")}
    if dims["linear_num_value_heads"] % dims["linear_num_key_heads"]:
        raise HFConfigError(f"{family}: linear_num_value_heads={dims['linear_num_value_heads']} is "
                            f"not a multiple of linear_num_key_heads="
                            f"{dims['linear_num_key_heads']}")
    return dict(
        experimental_attention_variant="gated_delta_net",
        # megatron's per-layer pattern: 1 = linear attention, 0 = full attention (megatron-core
        # experimental_attention_variant_module_specs.py get_linear_attention_pattern, 0.16.1 and 0.19.2)
        linear_attention_freq=[int(t == "linear_attention") for t in types],
        **dims,
    )


@dataclass(frozen=True)
class GatedDeltaNet(Feature):
    """Gated DeltaNet layers in place of attention on the layers `layer_types` names
    "linear_attention" (module docstring); the others keep the family's attention."""

    def fields(self, hf: Mapping[str, Any], draft: Draft) -> None:
        draft.config.update(gdn_fields(hf, draft.family, draft.config["num_layers"]))

    def settle(self, kwargs: dict[str, Any], build: BuildContext) -> None:
        import torch
        if not torch.cuda.is_available():
            # the torch forms of the DeltaNet's kernels (layers.py): megatron's torch convolution
            # and chunked delta rule are the ones deterministic_mode selects
            kwargs["deterministic_mode"] = True
        if kwargs.get("context_parallel_size", 1) > 1:
            raise HFConfigError(f"{build.family}: context parallelism with Gated DeltaNet layers "
                                "is not supported (megatron-core 0.16.1's layer has none: "
                                "gated_delta_net.py)")

    def block_config(self, config: Any) -> Any:
        # megatron-core 0.19 refuses the variant in its GPT spec (gpt_layer_specs.
        # get_gpt_decoder_block_spec): the block's layers come from the config without it, and
        # layer_spec puts the DeltaNet in
        return dataclasses.replace(config, experimental_attention_variant=None,
                                   linear_attention_freq=None)

    def layer_spec(self, spec: Any, layer: LayerContext) -> Any:
        from model_specs.features.gated_delta_net.layers import use_gated_delta_net
        return use_gated_delta_net(spec, layer.config, layer.transformer_engine, layer.vp_stage,
                                   layer.pp_rank)

    def weight_rules(self, hf: Mapping[str, Any], rules: list[WeightRule]) -> list[WeightRule]:
        # A DeltaNet layer has these in place of every `self_attention.` rule of the others; the
        # in_proj layout: weights/layouts.py
        types = layer_types(hf, int(hf["num_hidden_layers"]))
        linear = [i for i, t in enumerate(types) if t == "linear_attention"]
        full = [i for i, t in enumerate(types) if t != "linear_attention"]
        dims = tuple(int(hf[k]) for k in ("linear_num_key_heads", "linear_key_head_dim",
                                          "linear_num_value_heads", "linear_value_head_dim"))
        a, s, on = L + "self_attention.", H + "linear_attn.", frozenset(linear)
        mine = [WeightRule(a + m, tuple(s + n for n in hf_names), kind, tp_dim=tp,
                           slot="linear_attention", layers=on, layout=layout)
                for m, hf_names, kind, tp, layout in (
                    ("in_proj.weight", ("in_proj_qkvz.weight", "in_proj_ba.weight"), GDN_IN_PROJ,
                     0, dims),
                    ("conv1d.weight", ("conv1d.weight",), COPY, 0, ()),
                    ("A_log", ("A_log",), COPY, 0, ()),
                    ("dt_bias", ("dt_bias",), COPY, 0, ()),
                    ("out_norm.weight", ("norm.weight",), COPY, None, ()),
                    ("out_proj.weight", ("out_proj.weight",), COPY, 1, ()))]
        attention = restricted(rules, lambda r: r.scope == "layer" and ".self_attention." in
                               r.megatron, full)
        return attention + mine
