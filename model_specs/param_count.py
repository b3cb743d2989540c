"""Parameter counts of a ModelSpec (or a torch-free ModelShape), from its config alone (nothing is
built).

    counts = param_count(model_spec_for("/models/Qwen3-30B-A3B"))
    counts.total, counts.active          # 30.5e9, 3.3e9

Counted as megatron holds the model: embedding, output layer (unless tied), per layer the fused
q/k/v projection (+ bias, + the output gate's rows), output projection, QK-norm (or multi-latent
attention's projections and latent norms), attention sinks (one per head), or on Qwen3-Next's
linear layers a Gated DeltaNet's projections, convolution and norm; the two RMSNorms, then either
the dense MLP or the router (+ expert bias), every routed expert and the shared expert (+ gate);
the final norm. With add_bias_linear (gpt-oss) the output projection, the router and every MLP
have biases too. `active` is what one token passes
through: the same, with `moe_router_topk` routed experts per MoE layer instead of all of them.
Vendors differ on whether the embedding tables count as active (Qwen's published "A3B" / "A22B"
and DeepSeek-V3's "37B" include them, GLM-4.5's "32B active" does not, gpt-oss's "5.1B active"
counts the output layer and not the embedding), hence `embedding` and `output` separately.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free: the planner counts a ModelShape (shape.py), others a ModelSpec
    from megatron.core.transformer import TransformerConfig

    from model_specs.build import ModelSpec
    from model_specs.shape import ModelShape, ShapeConfig


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts of one model (numbers of scalars)."""

    total: int
    """Every parameter."""
    active: int
    """Parameters one token uses: all but the routed experts it is not sent to."""
    embedding: int
    """The input embedding table (vocab x hidden)."""
    output: int
    """The output layer (vocab x hidden; 0 when tied to the embedding)."""
    routed_experts: int
    """All routed experts of all MoE layers."""


def _attention(c: TransformerConfig | ShapeConfig) -> int:
    if c.multi_latent_attention:
        return _mla(c) + 2 * c.hidden_size          # + input_layernorm, pre_mlp_layernorm
    h, d = c.hidden_size, c.kv_channels
    q, kv = c.num_attention_heads * d, (c.num_query_groups or c.num_attention_heads) * d
    n = h * (q + 2 * kv) + q * h                    # linear_qkv + linear_proj
    n += h * q if c.attention_output_gate else 0    # the output gate's rows of linear_qkv
    n += (q + 2 * kv) if c.add_qkv_bias else 0
    n += 2 * d if c.qk_layernorm else 0             # q_layernorm, k_layernorm (per head dim)
    n += h if c.add_bias_linear else 0              # linear_proj bias
    n += c.num_attention_heads if c.softmax_type == "learnable" else 0   # sinks
    return n + 2 * h                                # input_layernorm, pre_mlp_layernorm


def _gated_delta_net(c: TransformerConfig | ShapeConfig) -> int:
    """A Gated DeltaNet layer (megatron/core/ssm/gated_delta_net.py): in_proj to q, k, v, the
    gate z, beta and alpha; the depthwise conv over q, k, v (no bias); dt_bias and A_log per value
    head; the output norm (per value-head channel); out_proj; and the layer's two norms."""
    h = c.hidden_size
    kd, kh, vd, heads, conv = (c.linear_key_head_dim, c.linear_num_key_heads, c.linear_value_head_dim,
                               c.linear_num_value_heads, c.linear_conv_kernel_dim)
    if kd is None or kh is None or vd is None or heads is None or conv is None:
        raise ValueError("a Gated DeltaNet layer needs linear_key/value_head_dim, linear_num_key/value_heads "
                         "and linear_conv_kernel_dim")
    qk, v = kd * kh, vd * heads
    return (h * (2 * qk + 2 * v + 2 * heads) + (2 * qk + v) * conv + 2 * heads + vd + v * h + 2 * h)


def _linear_layers(c: TransformerConfig | ShapeConfig) -> int:
    """How many layers are Gated DeltaNet layers (megatron's pattern: 1 = linear)."""
    if c.experimental_attention_variant != "gated_delta_net":
        return 0
    freq = c.linear_attention_freq
    if freq is None:
        raise ValueError("gated_delta_net layers need linear_attention_freq (an int or a 0/1 list)")
    if isinstance(freq, int):  # every freq-th layer full attention (get_linear_attention_pattern)
        return sum(1 for i in range(c.num_layers) if (i + 1) % freq != 0)
    return sum(int(x) for x in freq)


def _mla(c: TransformerConfig | ShapeConfig) -> int:
    """Multi-latent attention (model_specs/features/mla/): q's down- and up-projection and norm (or one
    q projection), the kv latent's down-projection (+ the shared rope key) and norm, its
    up-projection to keys and values, the output projection."""
    h, n = c.hidden_size, c.num_attention_heads
    q_head = c.qk_head_dim + c.qk_pos_emb_head_dim
    q = h * n * q_head if c.q_lora_rank is None else \
        h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * n * q_head
    kv = h * (c.kv_lora_rank + c.qk_pos_emb_head_dim) + c.kv_lora_rank
    kv += c.kv_lora_rank * n * (c.qk_head_dim + c.v_head_dim)
    return q + kv + n * c.v_head_dim * h


def _mlp(c: TransformerConfig | ShapeConfig, ffn: int) -> int:
    gated = 2 if c.gated_linear_unit else 1
    bias = gated * ffn + c.hidden_size if c.add_bias_linear else 0  # fc1, fc2 biases
    return (gated + 1) * c.hidden_size * ffn + bias


def _moe_layers(c: TransformerConfig | ShapeConfig) -> int:
    if not c.num_moe_experts:
        return 0
    freq = c.moe_layer_freq
    if isinstance(freq, int):
        return sum(1 for i in range(c.num_layers) if i % freq == 0)
    return sum(int(x) for x in freq)


def param_count(spec: ModelSpec | ModelShape) -> ParamCount:
    """The counts of `spec` (see the module docstring)."""
    c = spec.config
    h, experts = c.hidden_size, c.num_moe_experts or 0
    moe = _moe_layers(c)
    dense = c.num_layers - moe
    per_expert = _mlp(c, c.moe_ffn_hidden_size or 0)
    moe_fixed = experts * h                         # router
    moe_fixed += experts if c.add_bias_linear else 0  # router bias (gpt-oss)
    moe_fixed += experts if c.moe_router_enable_expert_bias else 0
    if c.moe_shared_expert_intermediate_size:
        moe_fixed += _mlp(c, c.moe_shared_expert_intermediate_size)
        moe_fixed += h if c.moe_shared_expert_gate else 0
    embedding = spec.vocab_size * h
    output = 0 if spec.share_embeddings_and_output_weights else spec.vocab_size * h
    shared = embedding + output + h                 # + final norm
    linear = _linear_layers(c)
    layers = ((c.num_layers - linear) * _attention(c) + linear * _gated_delta_net(c)
              + dense * _mlp(c, c.ffn_hidden_size) + moe * moe_fixed)
    routed = moe * experts * per_expert
    active_routed = moe * (c.moe_router_topk or 0) * per_expert
    return ParamCount(total=shared + layers + routed, active=shared + layers + active_routed,
                      embedding=embedding, output=output, routed_experts=routed)
