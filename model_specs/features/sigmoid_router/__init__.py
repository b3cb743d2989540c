"""The sigmoid router with an expert bias and group-limited top-k (GLM-4.5, DeepSeek-V3, Kimi-K2):
the `SigmoidRouter` feature. Its fields are torch-free; the router module: layers.py.

s = sigmoid(logits); the experts are CHOSEN by s + bias (`e_score_correction_bias`, optionally
first restricted to the best `topk_group` of `n_group` groups) but WEIGHTED by s alone,
renormalised, times routed_scaling_factor (transformers modeling_glm4_moe.py,
Glm4MoeTopkRouter.forward). megatron-core computes exactly that with score_function="sigmoid"
and its expert bias (moe_utils.topk_routing_with_score_function: `scores_for_routing = scores +
expert_bias` selects, `scores.gather` weighs, `/ (sum + 1e-20)`, `* scaling_factor`). What
megatron cannot express is refused by name: norm_topk_prob=False or top-1 (megatron always
renormalises when top-k > 1 and never when k = 1, in the same function), and group scores other
than the sum of each group's top 2 (megatron sums the top topk/topk_group,
moe_utils.group_limited_topk; HF always the top 2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from model_specs.features import Draft, LayerContext
from model_specs.features.moe import Router, moe_layers
from model_specs.hf.config import HFConfigError
from model_specs.weights.rules import H, L, WeightRule


@dataclass(frozen=True)
class SigmoidRouter(Router):
    """Sigmoid scores, the expert bias in the choice only, groups, scaling (module docstring)."""

    def fields(self, hf: Mapping[str, Any], draft: Draft) -> None:
        family, experts = draft.family, draft.config["num_moe_experts"]
        topk = draft.config["moe_router_topk"]
        # DeepSeek's own config class (remote code) names the router; transformers reads none of
        # these fields and always routes as below, so another value describes another model.
        for key, implemented in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"),
                                 ("moe_layer_freq", 1)):
            if hf.get(key) not in (None, implemented):
                raise HFConfigError(f"{family}: {key}={hf[key]!r} is not supported: expected "
                                    f"{implemented!r}, the only one transformers' model computes "
                                    "(it does not read the field)")
        if not hf.get("norm_topk_prob", True):
            raise HFConfigError(f"{family}: norm_topk_prob=false is not supported: megatron-core's "
                                "sigmoid router always renormalises the top-k weights "
                                "(moe_utils.topk_routing_with_score_function)")
        if topk == 1:
            raise HFConfigError(f"{family}: num_experts_per_tok=1 is not supported: HF "
                                "renormalises the single weight to 1, megatron-core's sigmoid "
                                "router keeps it")
        groups, group_topk = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
        draft.config.update(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=0.0,  # the bias is pretrained and frozen (layers.py)
            moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
            moe_router_dtype="fp32",  # HF routes in fp32 (Glm4MoeTopkRouter: F.linear on .float())
        )
        if groups > 1:
            if experts % groups or not 0 < group_topk <= groups:
                raise HFConfigError(f"{family}: n_group={groups}, topk_group={group_topk} do not "
                                    f"fit num_experts={experts}")
            if topk // group_topk != 2:
                raise HFConfigError(
                    f"{family}: n_group={groups} with num_experts_per_tok={topk} and topk_group="
                    f"{group_topk} is not supported: HF scores a group by its top-2 experts, "
                    f"megatron-core by its top num_experts_per_tok // topk_group = "
                    f"{topk // group_topk} (moe_utils.group_limited_topk)")
            draft.config.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
        elif group_topk != 1:
            raise HFConfigError(f"{family}: topk_group={group_topk} with n_group=1, expected 1")

    def layer_spec(self, spec: Any, layer: LayerContext) -> Any:
        if not layer.config.moe_router_enable_expert_bias:  # an override turned it off
            return spec
        from model_specs.features.sigmoid_router.layers import use_expert_bias_router
        return use_expert_bias_router(spec)

    def weight_rules(self, hf: Mapping[str, Any], rules: list[WeightRule]) -> list[WeightRule]:
        # megatron keeps the expert bias as a buffer; layers.ExpertBiasRouter makes it a frozen
        # parameter under the same name (fp32, as HF keeps e_score_correction_bias).
        return rules + [WeightRule(L + "mlp.router.expert_bias",
                                   (H + "mlp.gate.e_score_correction_bias",), slot="router",
                                   layers=moe_layers(hf))]
