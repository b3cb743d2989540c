"""The TransformerConfig fields of Qwen3-Next's hybrid layers: plain numbers, torch-free, so that
shape.py (the planner) and param_count read the same mapping as a built model would.

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
  by its sigmoid before o_proj (megatron-core's `attention_output_gate`).
Every RMSNorm outside the DeltaNet's is zero-centred, (1 + weight) * x / rms(x)
(`layernorm_zero_centered_gamma`). The MoE block is Qwen2-MoE's: softmax router, routed experts,
one shared expert scaled by sigmoid(shared_expert_gate(x)).

    fields = gdn_fields(hf, "qwen3_next", num_layers=48)
    fields["linear_attention_freq"][:4]      # [1, 1, 1, 0]: megatron's pattern, 1 = linear
"""
from __future__ import annotations

from typing import Any, Mapping

from model_specs.hf.config import HFConfigError, require

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
    """Qwen3-Next's TransformerConfig fields beyond a Qwen3-MoE's; what megatron-core would
    compute differently is refused by the field's name."""
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
                            f"not a multiple of linear_num_key_heads={dims['linear_num_key_heads']}")
    return dict(
        experimental_attention_variant="gated_delta_net",
        # megatron's per-layer pattern: 1 = linear attention (experimental_attention_variant_
        # module_specs.py, get_linear_attention_pattern), 0 = full attention
        linear_attention_freq=[int(t == "linear_attention") for t in types],
        attention_output_gate=True,
        layernorm_zero_centered_gamma=True,
        **dims,
    )
