"""A bias on every linear layer (gpt-oss): megatron-core's `add_bias_linear` gives the output
projection, the router (Router.__init__; its logits by addmm, RouterGatingLinearFunction.forward)
and every expert's fc1 / fc2 a bias (the `LinearBias` feature; the experts' fc2 on the local spec:
layers.py).

An expert's fc2 bias is added once per token times its routing weight (MLP.forward), as HF adds
down_proj_bias before weighting. Under expert-tensor parallelism each expert-TP rank adds it to
its partial sum before the ranks' sums are reduced (RowParallelLinear.forward, no reduce for
experts), so the bias would count expert_tensor_parallel_size times; megatron asserts ETP == 1 for
MoE with biases (TransformerConfig.__post_init__), and this feature refuses it first, by name,
with the setting to change. The router's and the experts' HF names are their storage's
(stacked_experts.py); the output projection's is here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from model_specs.features import BuildContext, Draft, Feature, LayerContext
from model_specs.hf.config import HFConfigError
from model_specs.weights.rules import H, L, WeightRule


@dataclass(frozen=True)
class LinearBias(Feature):
    """Biases on the output projection, the router and the experts (module docstring)."""

    def fields(self, hf: Mapping[str, Any], draft: Draft) -> None:
        if not hf.get("attention_bias", True):
            raise HFConfigError(f"{draft.family}: attention_bias=false is not supported: "
                                "megatron-core's add_bias_linear gives the output projection, the "
                                "router and the experts a bias too, which the HF model then lacks")
        draft.config["add_bias_linear"] = True

    def settle(self, kwargs: dict[str, Any], build: BuildContext) -> None:
        etp = kwargs.get("expert_tensor_parallel_size") or \
            kwargs.get("tensor_model_parallel_size", 1)
        if kwargs.get("num_moe_experts") and kwargs.get("add_bias_linear") and etp > 1:
            # megatron asserts it too (TransformerConfig.__post_init__), without naming the way out
            raise HFConfigError(f"{build.family}: expert_tensor_parallel_size={etp} with expert "
                                "biases is not supported: each expert-TP rank adds the fc2 bias "
                                "to its partial sum before the sums are reduced (megatron-core "
                                "MLP.forward, RowParallelLinear.forward), so it would count "
                                "once per rank; set parallel.expert_tensor: 1")

    def layer_spec(self, spec: Any, layer: LayerContext) -> Any:
        c = layer.config
        if not (c.num_moe_experts and c.add_bias_linear) or layer.transformer_engine:
            return spec
        from model_specs.features.linear_bias.layers import use_expert_fc2
        return use_expert_fc2(spec)  # expert biases on one expert-TP rank (layers.py)

    def weight_rules(self, hf: Mapping[str, Any], rules: list[WeightRule]) -> list[WeightRule]:
        return rules + [WeightRule(L + "self_attention.linear_proj.bias",
                                   (H + "self_attn.o_proj.bias",), slot="attention_out")]
