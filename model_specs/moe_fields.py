"""The TransformerConfig fields of an HF MoE config (routers, shared experts): plain numbers and
names, torch-free, so that shape.py (the planner) reads the same mapping as the built model.
What the fields mean and the megatron-core lines they match: moe.py's docstring."""
from __future__ import annotations

from typing import Any, Mapping

from model_specs.hf.config import HFConfigError, moe_layer_pattern, require

ROUTERS = ("softmax", "sigmoid")
SHARED_EXPERTS = (None, "gated", "plain")


def moe_config_fields(hf: Mapping[str, Any], family: str, num_layers: int, router: str,
                      shared_expert: str | None,
                      expert_size_field: str = "moe_intermediate_size") -> dict[str, Any]:
    """The TransformerConfig fields of an HF MoE config (see the module docstring)."""
    if router not in ROUTERS or shared_expert not in SHARED_EXPERTS:
        raise ValueError(f"{family}: router={router!r}, shared_expert={shared_expert!r}; expected "
                         f"one of {ROUTERS} and {SHARED_EXPERTS}")
    experts = int(require(hf, "num_experts", family))
    topk = int(require(hf, "num_experts_per_tok", family))
    if not 0 < topk <= experts:
        raise HFConfigError(f"{family}: num_experts_per_tok={topk}, expected 1..{experts} "
                            f"(num_experts={experts})")
    fields: dict[str, Any] = dict(
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=int(require(hf, expert_size_field, family)),
        moe_layer_freq=moe_layer_pattern(hf, num_layers),
        # RL fine-tuning: no load-balancing loss by default (it would enter the GSPO gradient).
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
    )
    if router == "softmax":
        pre_softmax = not bool(hf.get("norm_topk_prob", True))
        if topk == 1 and not pre_softmax:
            raise HFConfigError(f"{family}: num_experts_per_tok=1 with the softmax taken over the "
                                "top-k is not supported: HF weighs the one expert by 1, megatron-core "
                                "takes top-1 only after a full softmax "
                                "(transformer_config.py:1641)")
        fields.update(moe_router_score_function="softmax", moe_router_pre_softmax=pre_softmax)
    else:
        fields.update(_sigmoid_router_fields(hf, family, experts, topk))
    if shared_expert == "gated":
        size = int(require(hf, "shared_expert_intermediate_size", family))
        if size <= 0:
            raise HFConfigError(f"{family}: shared_expert_intermediate_size={size}, expected > 0")
        fields.update(moe_shared_expert_intermediate_size=size, moe_shared_expert_gate=True)
    elif shared_expert == "plain":
        n = int(require(hf, "n_shared_experts", family))
        if n <= 0:
            raise HFConfigError(f"{family}: n_shared_experts={n} is not supported (expected >= 1)")
        fields.update(moe_shared_expert_intermediate_size=n * fields["moe_ffn_hidden_size"],
                      moe_shared_expert_gate=False)
    return fields


def _sigmoid_router_fields(hf: Mapping[str, Any], family: str, experts: int,
                           topk: int) -> dict[str, Any]:
    # DeepSeek's own config class (remote code) names the router; transformers reads none of
    # these fields and always routes as below, so another value describes another model.
    for key, implemented in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"),
                             ("moe_layer_freq", 1)):
        if hf.get(key) not in (None, implemented):
            raise HFConfigError(f"{family}: {key}={hf[key]!r} is not supported: expected "
                                f"{implemented!r}, the only one transformers' model computes (it "
                                "does not read the field)")
    if not hf.get("norm_topk_prob", True):
        raise HFConfigError(f"{family}: norm_topk_prob=false is not supported: megatron-core's "
                            "sigmoid router always renormalises the top-k weights "
                            "(moe_utils.py:724)")
    if topk == 1:
        raise HFConfigError(f"{family}: num_experts_per_tok=1 is not supported: HF renormalises "
                            "the single weight to 1, megatron-core's sigmoid router keeps it")
    groups, group_topk = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    fields: dict[str, Any] = dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,  # the bias is pretrained and frozen (module docstring)
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        moe_router_dtype="fp32",  # HF routes in fp32 (Glm4MoeTopkRouter: F.linear on .float())
    )
    if groups > 1:
        if experts % groups or not 0 < group_topk <= groups:
            raise HFConfigError(f"{family}: n_group={groups}, topk_group={group_topk} do not fit "
                                f"num_experts={experts}")
        if topk // group_topk != 2:
            raise HFConfigError(
                f"{family}: n_group={groups} with num_experts_per_tok={topk} and topk_group="
                f"{group_topk} is not supported: HF scores a group by its top-2 experts, "
                f"megatron-core by its top num_experts_per_tok // topk_group = "
                f"{topk // group_topk} (moe_utils.py:554)")
        fields.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    elif group_topk != 1:
        raise HFConfigError(f"{family}: topk_group={group_topk} with n_group=1, expected 1")
    return fields
