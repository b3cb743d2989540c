"""Mixture-of-experts layers: HF router / shared-expert fields -> megatron-core MoE config fields,
and the router whose expert bias the rest of the project can carry.

Two routers (FamilyTraits.router):
- "softmax" (Qwen2-MoE, Qwen3-MoE): softmax over the router logits, top-k, renormalised when
  norm_topk_prob. norm_topk_prob=True equals megatron's top-k-then-softmax
  (moe_router_pre_softmax=False); False keeps the full-softmax probabilities (pre_softmax=True).
- "sigmoid" (GLM-4.5, as DeepSeek-V3): s = sigmoid(logits); the experts are CHOSEN by s + bias
  (`e_score_correction_bias`, optionally first restricted to the best `topk_group` of `n_group`
  groups) but WEIGHTED by s alone, renormalised, times routed_scaling_factor
  (transformers modeling_glm4_moe.py, Glm4MoeTopkRouter.forward). megatron-core computes exactly
  that with score_function="sigmoid" and its expert bias (moe_utils.py:719-728:
  `scores_for_routing = scores + expert_bias` selects, `scores.gather` weighs, `/ (sum + 1e-20)`,
  `* scaling_factor`). What megatron cannot express is refused by name: norm_topk_prob=False
  or top-1 (megatron always renormalises when top-k > 1 and never when k = 1, moe_utils.py:724),
  and group scores other than the sum of each group's top 2 (megatron sums the top
  topk/topk_group, moe_utils.py:554; HF always the top 2).

Shared experts (FamilyTraits.shared_expert): "gated" (Qwen2-MoE: one shared MLP of
shared_expert_intermediate_size, times sigmoid(shared_expert_gate(x)); megatron's
SharedExpertMLP with gate=True computes sigmoid(x @ gate_weight.T) * mlp(x),
shared_experts.py:129-131) or "plain" (GLM-4.5: n_shared_experts x moe_intermediate_size, no gate).

The expert bias: megatron's TopKRouter keeps it as a persistent *buffer* `expert_bias` (fp32),
and nudges it after every optimizer step by moe_router_bias_update_rate
(finalize_model_grads.py:477). For RL fine-tuning the bias is a pretrained constant: the update
rate is 0 (an override can set another), and `ExpertBiasRouter` holds the same tensor under the
same name as a frozen (requires_grad=False) *parameter*, so that every path of
this project that walks parameters (full state dicts, the HF converters, the weight sync into
SGLang, the KL reference copy) carries it, while DDP and the optimizers skip it (they take only
parameters that require grad). The checkpoint key is megatron's own
(`decoder.layers.{i}.mlp.router.expert_bias`).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec


class ExpertBiasRouter(TopKRouter):
    """megatron-core's TopKRouter, its `expert_bias` a frozen fp32 parameter instead of a buffer
    (module docstring). Routing is TopKRouter's, unchanged.

    TopKRouter is built without the bias and the two tensors it would have registered
    (router.py:162-183: `local_tokens_per_expert`, `expert_bias`) are added here, on the current
    CUDA device or, without CUDA, the CPU: megatron's own calls torch.cuda.current_device(),
    which fails on a CPU-only machine (the checkpoint converters run there)."""

    def __init__(self, config: TransformerConfig, *args: Any, **kwargs: Any) -> None:
        plain = copy.copy(config)  # a shallow copy, as SharedExpertMLP makes (shared_experts.py:46)
        plain.moe_router_enable_expert_bias = False
        super().__init__(plain, *args, **kwargs)
        self.config = config
        self.enable_expert_bias = bool(config.moe_router_enable_expert_bias)
        if self.enable_expert_bias:
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
            zeros = torch.zeros(config.num_moe_experts, dtype=torch.float32, device=device)
            del self.local_tokens_per_expert, self.expert_bias  # plain attributes (None) so far
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
    if isinstance(spec, MoESubmodules):
        if spec.router is not TopKRouter:
            raise ValueError(f"MoE spec has router {spec.router}, expected megatron's TopKRouter")
        return dataclasses.replace(spec, router=ExpertBiasRouter)
    if isinstance(spec, list):
        return [use_expert_bias_router(s) for s in spec]
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, submodules=use_expert_bias_router(spec.submodules))
    if isinstance(spec, functools.partial):  # megatron-core 0.19 builds some modules as partials
        kwargs = {k: use_expert_bias_router(v) for k, v in spec.keywords.items()}
        return functools.partial(spec.func, *spec.args, **kwargs)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: use_expert_bias_router(getattr(spec, f.name))
                   for f in dataclasses.fields(spec) if f.init}
        return dataclasses.replace(spec, **changes)
    return spec
