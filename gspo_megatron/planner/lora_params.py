"""The LoRA adapters' parameters, per rank and in all: what a LoRA run's weights, gradients, optimizer
state and weight sync count (memory.py, plan.py). Torch-free: the planner reads a ModelShape.

One rank of layer i holds, for rank r (gspo_megatron/lora/adapters.py):
    linear_qkv   A [r, h]        + B [(q + 2 kv) / TP, r]
    linear_proj  A [r, q / TP]   + B [h, r]
    linear_fc1   A [r, h]        + B [gated x ffn / TP, r]     dense MLP, shared experts
    linear_fc2   A [r, ffn / TP] + B [h, r]
    routed experts, E / EP of them (expert-TP 1): fc1 A [r, h] + B [gated x ffn, r], fc2 A [r, ffn]
    + B [h, r] each; with shared_outer fc1's A and fc2's B once per layer (dense: reduced over
    data parallel like the attention's adapters).
Multi-latent attention has no linear_qkv: only linear_proj's adapter there (A [r, heads x v / TP]).
The base's parameters stay as memory.py counts them, frozen: weights only, no gradient or
optimizer state (DDP and megatron's optimizer skip them).
"""
from __future__ import annotations

from typing import Any

from gspo_megatron.lora.lora_settings import LoraSettings


def _moe(c: Any, i: int) -> bool:
    if not c.num_moe_experts:
        return False
    freq = c.moe_layer_freq
    return (i % freq == 0) if isinstance(freq, int) else bool(freq[i])


def _mlp(c: Any, ffn: int, r: int, tp: int, lora: LoraSettings) -> int:
    gated = 2 if c.gated_linear_unit else 1
    h = c.hidden_size
    fc1 = r * h + gated * ffn // tp * r if "linear_fc1" in lora.targets else 0
    fc2 = r * ffn // tp + h * r if "linear_fc2" in lora.targets else 0
    return fc1 + fc2


def layer_adapter_params(c: Any, i: int, tp: int, ep: int, lora: LoraSettings) -> tuple[int, int]:
    """(dense, expert) adapter parameters of layer i on one rank (module docstring)."""
    if not lora.enabled:
        return 0, 0
    r, h, n = lora.rank, c.hidden_size, c.num_attention_heads
    dense = expert = 0
    if c.multi_latent_attention:
        q = n * c.v_head_dim
        dense += r * q // tp + h * r if "linear_proj" in lora.targets else 0
    else:
        d = c.kv_channels
        q, kv = n * d, (c.num_query_groups or n) * d
        dense += r * h + (q + 2 * kv) // tp * r if "linear_qkv" in lora.targets else 0
        dense += r * q // tp + h * r if "linear_proj" in lora.targets else 0
    if not _moe(c, i):
        return dense + _mlp(c, c.ffn_hidden_size, r, tp, lora), expert
    if c.moe_shared_expert_intermediate_size:
        dense += _mlp(c, c.moe_shared_expert_intermediate_size, r, tp, lora)
    if lora.expert_targets():
        gated = 2 if c.gated_linear_unit else 1
        ffn, local = c.moe_ffn_hidden_size, c.num_moe_experts // ep
        fc1_a, fc1_b = r * h, gated * ffn * r
        fc2_a, fc2_b = r * ffn, h * r
        shared = lora.experts == "shared_outer"
        if "linear_fc1" in lora.targets:
            expert += local * fc1_b + (0 if shared else local * fc1_a)
            dense += fc1_a if shared else 0
        if "linear_fc2" in lora.targets:
            expert += local * fc2_a + (0 if shared else local * fc2_b)
            dense += fc2_b if shared else 0
    return dense, expert


def model_adapter_params(c: Any, lora: LoraSettings) -> int:
    """Every adapter parameter of the model (TP1, EP1): what one adapter sync sends per server."""
    return sum(sum(layer_adapter_params(c, i, 1, 1, lora)) for i in range(c.num_layers))
