"""The sigmoid router's megatron side: a router whose expert bias the rest of the project carries
(what the router computes and its fields: __init__.py).

megatron's TopKRouter keeps the expert bias as a persistent *buffer* `expert_bias` (fp32), and
nudges it after every optimizer step by moe_router_bias_update_rate
(finalize_model_grads._update_router_expert_bias).
For RL fine-tuning the bias is a pretrained constant: the update rate is 0 (an override can set
another), and `ExpertBiasRouter` holds the same tensor under the same name as a frozen
(requires_grad=False) *parameter*, so that every path of this project that walks parameters (full
state dicts, the HF converters, the weight sync into SGLang, the KL reference copy) carries it,
while DDP and the optimizers skip it (they take only parameters that require grad). The
checkpoint key is megatron's own (`decoder.layers.{i}.mlp.router.expert_bias`).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter

from model_specs.spec_rewrite import rewrite_spec


class ExpertBiasRouter(TopKRouter):
    """megatron-core's TopKRouter, its `expert_bias` a frozen fp32 parameter instead of a buffer
    (module docstring). Routing is TopKRouter's, unchanged.

    TopKRouter is built without the bias and the two tensors it would have registered
    (TopKRouter.__init__: `local_tokens_per_expert`, `expert_bias`) are added here, on the current
    CUDA device or, without CUDA, the CPU: megatron's own calls torch.cuda.current_device(),
    which fails on a CPU-only machine (the checkpoint converters run there)."""

    def __init__(self, config: TransformerConfig, *args: Any, **kwargs: Any) -> None:
        plain = copy.copy(config)  # a shallow copy, as 0.16's SharedExpertMLP.__init__ makes
        plain.moe_router_enable_expert_bias = False
        super().__init__(plain, *args, **kwargs)
        self.config = config
        self.enable_expert_bias = bool(config.moe_router_enable_expert_bias)
        if self.enable_expert_bias:
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
            zeros = torch.zeros(config.num_moe_experts, dtype=torch.float32, device=device)
            for plain in ("local_tokens_per_expert", "expert_bias"):  # plain attributes (None) so far
                delattr(self, plain)
            self.register_buffer("local_tokens_per_expert", zeros.clone(), persistent=False)
            self.expert_bias = torch.nn.Parameter(zeros, requires_grad=False)

    def _apply(self, fn, *args: Any, **kwargs: Any):
        # Float16Module casts every floating tensor to bf16/fp16 before weights are loaded; the
        # router keeps the bias in fp32 (router.py, _maintain_float32_expert_bias), so that the
        # loaded value is never rounded.
        out = super()._apply(fn, *args, **kwargs)
        self._maintain_float32_expert_bias()
        return out


def use_expert_bias_router(spec: Any) -> Any:
    """A copy of a block / layer spec whose MoE layers build ExpertBiasRouter."""
    def router(s: Any) -> Any:
        if not isinstance(s, MoESubmodules):
            return None
        if s.router is not TopKRouter:
            raise ValueError(f"MoE spec has router {s.router}, expected megatron's TopKRouter")
        return dataclasses.replace(s, router=ExpertBiasRouter)
    return rewrite_spec(spec, router)
