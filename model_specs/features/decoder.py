"""The decoder every family is: embedding, per layer a norm, a token mixer (another feature: GQA,
MLA, Gated DeltaNet), a norm and a gated SiLU MLP, then a final RMSNorm and the output layer
(tied to the embedding when `tie_word_embeddings`). families.Family puts it first in every family.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from model_specs.features import BuildContext, Draft, Feature
from model_specs.hf.config import HFConfigError, require
from model_specs.weights.rules import GATE_UP, H, L, WeightRule


@dataclass(frozen=True)
class Decoder(Feature):
    """The layers' skeleton (module docstring) and what no family maps (refused by name)."""

    def fields(self, hf: Mapping[str, Any], draft: Draft) -> None:
        fam = draft.family
        if hf.get("hidden_act", "silu") != "silu":
            raise HFConfigError(f"{fam}: hidden_act={hf['hidden_act']!r}, expected 'silu'")
        if hf.get("use_sliding_window"):
            raise HFConfigError(f"{fam}: use_sliding_window=true is not supported (sliding-window "
                                f"attention, sliding_window={hf.get('sliding_window')})")
        if hf.get("mlp_bias"):
            raise HFConfigError(f"{fam}: mlp_bias=true is not supported (megatron add_bias_linear "
                                "would also add a bias to the attention output projection)")
        quantization = hf.get("quantization_config")
        if quantization:
            method = quantization.get("quant_method") if isinstance(quantization, Mapping) \
                else quantization
            if not any(method in f.quantization for f in draft.features):
                # gpt-oss's MXFP4 experts are the exception: the converter dequantizes them on
                # import (gspo_megatron/checkpoint/mxfp4.py), the trainer holds bf16 / fp32 after
                raise HFConfigError(
                    f"{fam}: quantization_config (quant_method={method!r}) is not supported: the "
                    "trainer holds bf16 / fp32 weights; give it a bf16 copy of the model (for "
                    "DeepSeek-V3's fp8 weights: DeepSeek's inference/fp8_cast_bf16.py)")
        heads = int(require(hf, "num_attention_heads", fam))
        draft.config.update(
            num_layers=int(require(hf, "num_hidden_layers", fam)),
            hidden_size=int(require(hf, "hidden_size", fam)),
            ffn_hidden_size=int(require(hf, "intermediate_size", fam)),
            num_attention_heads=heads,
            num_query_groups=int(hf.get("num_key_value_heads") or heads),
            gated_linear_unit=True,
            add_bias_linear=False,
            normalization="RMSNorm",
            layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
            hidden_dropout=0.0,
            attention_dropout=0.0,
            attention_softmax_in_fp32=True,
            init_method_std=float(hf.get("initializer_range", 0.02)),
        )

    def config_fields(self, kwargs: dict[str, Any], build: BuildContext) -> None:
        import torch
        import torch.nn.functional as F

        dtype = build.params_dtype
        kwargs.update(activation_func=F.silu, params_dtype=dtype, pipeline_dtype=dtype,
                      bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)

    def weight_rules(self, hf: Mapping[str, Any], rules: list[WeightRule]) -> list[WeightRule]:
        mine = [
            WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",),
                       tp_dim=0, scope="model", slot="embedding"),
            WeightRule(L + "input_layernorm.weight", (H + "input_layernorm.weight",),
                       slot="input_norm"),
            WeightRule(L + "self_attention.linear_proj.weight", (H + "self_attn.o_proj.weight",),
                       tp_dim=1, slot="attention_out"),
            WeightRule(L + "pre_mlp_layernorm.weight", (H + "post_attention_layernorm.weight",),
                       slot="pre_mlp_norm"),
            WeightRule(L + "mlp.linear_fc1.weight",
                       (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), GATE_UP, tp_dim=0,
                       slot="mlp"),
            WeightRule(L + "mlp.linear_fc2.weight", (H + "mlp.down_proj.weight",), tp_dim=1,
                       slot="mlp"),
            WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",), scope="model",
                       slot="final_norm"),
        ]
        if not hf.get("tie_word_embeddings", False):
            mine.append(WeightRule("output_layer.weight", ("lm_head.weight",), tp_dim=0,
                                   scope="model", slot="output"))
        return rules + mine
