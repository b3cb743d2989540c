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

Experts with biases (gpt-oss, `add_bias_linear`): megatron's expert MLP adds its fc2 bias, times
the token's routing weight, to fc2's output in place (mlp.py:247). With one expert-TP rank and no
expert parallelism that output is what the TP reduction over a group of one returned as it was
(tensor_parallel/layers.py:1286-1295 in 0.16.1; mappings.py, _ReduceFromModelParallelRegion), and
autograd refuses the in-place add ("a view ... is being modified inplace"): a one-process model
with expert biases does not run. `ExpertRowParallelLinear` takes the path megatron takes for experts
under expert parallelism instead (`explicit_expert_comm`: fc2's output as computed, no reduction),
which over a group of one is the same sum; `use_expert_fc2` puts it in the experts' spec.
It also unmarks the fc2 bias as sequence-parallel: megatron marks every row-parallel bias so
(tensor_parallel/layers.py:1229) and, with sequence parallelism, sums the gradients of marked
parameters over the TP group (distributed/finalize_model_grads.py:353). An expert's bias gradient
is whole on the rank that holds the expert (its tokens come through the dispatcher, and expert-DP
replicas are reduced by DDP), so that sum added other ranks' experts' gradients to it: under
TP2 x EP2 the fc2 biases were 1.3e-3 off one process after one GSPO step, the log-probs 1.4e-6.
And it marks that bias as split over its expert-TP group of one (expert-TP is 1 wherever experts
have biases: common.py): the MoE optimizer counts a parameter in the gradient norm on the dense
TP group's rank 0 only unless it is marked TP-split (optimizer/optimizer.py:156,
optimizer/__init__.py:473 hands it the dense TP group), which left the other TP ranks' experts'
fc2 biases out of the norm (1.3914 against 1.3932 under TP2 x EP2), and out of gradient clipping.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import (RowParallelLinear,
                                                  set_tensor_model_parallel_attributes)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter

from model_specs.spec_rewrite import rewrite_spec


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
    def router(s: Any) -> Any:
        if not isinstance(s, MoESubmodules):
            return None
        if s.router is not TopKRouter:
            raise ValueError(f"MoE spec has router {s.router}, expected megatron's TopKRouter")
        return dataclasses.replace(s, router=ExpertBiasRouter)
    return rewrite_spec(spec, router)


class ExpertRowParallelLinear(RowParallelLinear):
    """megatron-core's RowParallelLinear for routed experts' fc2: over one expert-TP rank it skips
    the reduction over a group of one, as it does under expert parallelism, and its bias is not
    marked sequence-parallel (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.is_expert and self.tp_group.size() == 1:
            self.explicit_expert_comm = True
        if self.is_expert and self.bias is not None:
            self.bias.sequence_parallel = False  # its gradient is whole (module docstring)
            if self.tp_group.size() == 1:  # counted in the grad norm on every rank (docstring)
                set_tensor_model_parallel_attributes(self.bias, True, 0, 1)


def use_expert_fc2(spec: Any) -> Any:
    """A copy of a local block / layer spec whose routed experts' fc2 is ExpertRowParallelLinear
    (shared experts and dense MLPs keep theirs)."""
    def fc2(s: Any) -> Any:
        return ExpertRowParallelLinear if s is RowParallelLinear else None

    return rewrite_spec(spec, lambda s: dataclasses.replace(s, experts=rewrite_spec(s.experts, fc2))
                        if isinstance(s, MoESubmodules) else None)
