"""Routed experts: HF MoE fields -> megatron-core's MoE layer (the `MoE` feature), and the softmax
router of the Qwen families (`SoftmaxRouter`; the sigmoid router with an expert bias:
sigmoid_router/). Torch-free, so that shape.py (the planner) reads the same mapping as the
built model.

- MoE layers: `mlp_only_layers` / `decoder_sparse_step` (Qwen) or `first_k_dense_replace`
  (GLM-4.5, DeepSeek-V3) pick the dense ones (hf.config.moe_layer_pattern). No load-balancing
  loss by default: in RL fine-tuning it would enter the GSPO gradient.
- Shared experts: "gated" (Qwen2-MoE, Qwen3-Next: one shared MLP of
  shared_expert_intermediate_size, times sigmoid(shared_expert_gate(x)); megatron's
  SharedExpertMLP with gate=True computes sigmoid(x @ gate_weight.T) * mlp(x), megatron-core
  shared_experts.SharedExpertMLP.forward) or "plain" (GLM-4.5: n_shared_experts x
  moe_intermediate_size, no gate).
- The softmax router (Qwen2-MoE, Qwen3-MoE, gpt-oss): softmax over the router logits, top-k,
  renormalised when norm_topk_prob. norm_topk_prob=True equals megatron's top-k-then-softmax
  (moe_router_pre_softmax=False); False keeps the full-softmax probabilities (pre_softmax=True).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from model_specs.features import Draft, Feature
from model_specs.hf.config import HFConfigError, moe_layer_pattern, require
from model_specs.weights.rules import GATE_UP, H, L, WeightRule, restricted

SHARED_EXPERTS = (None, "gated", "plain")


class Router(Feature):
    """A router of an MoE family (the MoE feature needs exactly one)."""


def moe_layers(hf: Mapping[str, Any]) -> frozenset[int]:
    """The layers with routed experts (hf.config.moe_layer_pattern)."""
    return frozenset(i for i, x in enumerate(moe_layer_pattern(hf, int(hf["num_hidden_layers"])))
                     if x)


@dataclass(frozen=True)
class MoE(Feature):
    """Routed experts (module docstring); HF stores each expert's MLP under
    `mlp.experts.{e}.*` and the router as `mlp.gate` (stacked_experts.py for gpt-oss's)."""

    shared_expert: str | None = None
    """None, "gated" or "plain" (module docstring)."""
    expert_size_field: str = "moe_intermediate_size"
    """The HF field of one routed expert's ffn width (gpt-oss: intermediate_size)."""
    moe = True

    def __post_init__(self) -> None:
        if self.shared_expert not in SHARED_EXPERTS:
            raise ValueError(f"shared_expert={self.shared_expert!r}, expected one of "
                             f"{SHARED_EXPERTS}")

    def fields(self, hf: Mapping[str, Any], draft: Draft) -> None:
        family = draft.family
        if sum(isinstance(f, Router) for f in draft.features) != 1:
            raise ValueError(f"{family}: an MoE family needs one router feature, has "
                             f"{[f for f in draft.features if isinstance(f, Router)]}")
        experts = int(require(hf, "num_experts", family))
        topk = int(require(hf, "num_experts_per_tok", family))
        if not 0 < topk <= experts:
            raise HFConfigError(f"{family}: num_experts_per_tok={topk}, expected 1..{experts} "
                                f"(num_experts={experts})")
        draft.config.update(
            num_moe_experts=experts,
            moe_router_topk=topk,
            moe_ffn_hidden_size=int(require(hf, self.expert_size_field, family)),
            moe_layer_freq=moe_layer_pattern(hf, draft.config["num_layers"]),
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
        )
        if self.shared_expert == "gated":
            size = int(require(hf, "shared_expert_intermediate_size", family))
            if size <= 0:
                raise HFConfigError(f"{family}: shared_expert_intermediate_size={size}, "
                                    "expected > 0")
            draft.config.update(moe_shared_expert_intermediate_size=size,
                                moe_shared_expert_gate=True)
        elif self.shared_expert == "plain":
            n = int(require(hf, "n_shared_experts", family))
            if n <= 0:
                raise HFConfigError(f"{family}: n_shared_experts={n} is not supported "
                                    "(expected >= 1)")
            draft.config.update(
                moe_shared_expert_intermediate_size=n * draft.config["moe_ffn_hidden_size"],
                moe_shared_expert_gate=False)

    def weight_rules(self, hf: Mapping[str, Any], rules: list[WeightRule]) -> list[WeightRule]:
        moe = moe_layers(hf)
        dense = [i for i in range(int(hf["num_hidden_layers"])) if i not in moe]
        e, x = L + "mlp.experts.local_experts.{expert}.", H + "mlp.experts.{expert}."
        mine = [
            WeightRule(L + "mlp.router.weight", (H + "mlp.gate.weight",), slot="router"),
            WeightRule(e + "linear_fc1.weight", (x + "gate_proj.weight", x + "up_proj.weight"),
                       GATE_UP, tp_dim=0, scope="expert", slot="experts"),
            WeightRule(e + "linear_fc2.weight", (x + "down_proj.weight",), tp_dim=1,
                       scope="expert", slot="experts"),
        ]
        # Shared experts: an MLP over the (expert-independent) TP group, in every MoE layer; HF
        # names Qwen's `shared_expert` (with a gate), GLM-4.5's `shared_experts`.
        s, h = L + "mlp.shared_experts.", H + "mlp.shared_expert."
        if self.shared_expert == "plain":
            h = H + "mlp.shared_experts."
        if self.shared_expert:
            mine += [WeightRule(s + "linear_fc1.weight", (h + "gate_proj.weight",
                                                          h + "up_proj.weight"), GATE_UP,
                                tp_dim=0, slot="shared_experts"),
                     WeightRule(s + "linear_fc2.weight", (h + "down_proj.weight",), tp_dim=1,
                                slot="shared_experts")]
        if self.shared_expert == "gated":
            mine.append(WeightRule(s + "gate_weight", (H + "mlp.shared_expert_gate.weight",),
                                   slot="shared_experts"))
        dense_mlp = restricted(rules, lambda r: r.slot == "mlp", dense)
        return dense_mlp + restricted(mine, lambda r: True, moe)


@dataclass(frozen=True)
class SoftmaxRouter(Router):
    """Softmax over the router logits, top-k (module docstring)."""

    def fields(self, hf: Mapping[str, Any], draft: Draft) -> None:
        pre_softmax = not bool(hf.get("norm_topk_prob", True))
        if draft.config["moe_router_topk"] == 1 and not pre_softmax:
            raise HFConfigError(f"{draft.family}: num_experts_per_tok=1 with the softmax taken "
                                "over the top-k is not supported: HF weighs the one expert by 1, "
                                "megatron-core takes top-1 only after a full softmax "
                                "(TransformerConfig.__post_init__)")
        draft.config.update(moe_router_score_function="softmax", moe_router_pre_softmax=pre_softmax)
