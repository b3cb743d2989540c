"""Multi-latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight): the `MLA` feature. Its
TransformerConfig fields are plain numbers, torch-free, so that shape.py (the planner) reads the
same mapping as the built model; what they mean, the weights' table and the megatron-core modules
it adapts: layers.py's docstring.

    fields = mla_fields(hf, "deepseek_v3", num_heads=128)
    fields["q_lora_rank"], fields["qk_pos_emb_head_dim"], fields["rope_type"]   # 1536, 64, "yarn"
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from model_specs.features import BuildContext, Draft, Feature, LayerContext
from model_specs.features.rope import mla_rope_fields
from model_specs.hf.config import HFConfigError, require
from model_specs.weights.rules import H, L, WeightRule


@dataclass(frozen=True)
class MLA(Feature):
    """Multi-latent attention in place of GQA, with its own RoPE / YaRN (no Rope feature)."""

    def fields(self, hf: Mapping[str, Any], draft: Draft) -> None:
        draft.config.update(mla_fields(hf, draft.family, draft.config["num_attention_heads"]))
        # MLA rotates inside its attention; GPTModel builds none for it with "rope"
        draft.gpt_model.update(position_embedding_type="rope", rotary_percent=1.0,
                               rotary_base=draft.config["rotary_base"])

    def settle(self, kwargs: dict[str, Any], build: BuildContext) -> None:
        # megatron refuses rope fusion for MLA's plain RoPE and calls it experimental for its
        # YaRN (megatron-core MLATransformerConfig.__post_init__); the unfused path is the one
        # whose log-probs the tests hold to transformers'.
        kwargs["apply_rope_fusion"] = False
        if kwargs.get("tensor_model_parallel_size", 1) > 1 and not kwargs.get("sequence_parallel"):
            raise HFConfigError(f"{build.family}: multi-latent attention with tensor parallelism "
                                "needs sequence parallelism (parallel.sequence_parallel: true or "
                                "unset): without it each rank keeps only its heads' share of the "
                                "shared rope key's gradient (model_specs/features/mla/layers.py)")

    def config_class(self, draft: Draft) -> type | None:
        from megatron.core.transformer.transformer_config import MLATransformerConfig
        return MLATransformerConfig

    def layer_spec(self, spec: Any, layer: LayerContext) -> Any:
        from model_specs.features.mla.layers import adapt_mla_spec
        return adapt_mla_spec(spec, local=not layer.transformer_engine,
                              plain_q_proj=layer.config.q_lora_rank is None)

    def weight_rules(self, hf: Mapping[str, Any], rules: list[WeightRule]) -> list[WeightRule]:
        # q through a low-rank bottleneck with an RMSNorm, or one projection when q_lora_rank is
        # null; k and v from one latent with an RMSNorm. The down-projections are whole on every
        # TP rank in both specs (layers.py); the live parameter says which (actor/weights/full.py).
        a, s = L + "self_attention.", H + "self_attn."
        if hf.get("q_lora_rank") is None:
            q = [WeightRule(a + "linear_q_proj.weight", (s + "q_proj.weight",), tp_dim=0)]
        else:
            q = [WeightRule(a + "linear_q_down_proj.weight", (s + "q_a_proj.weight",), tp_dim=0),
                 WeightRule(a + "q_layernorm.weight", (s + "q_a_layernorm.weight",)),
                 WeightRule(a + "linear_q_up_proj.weight", (s + "q_b_proj.weight",), tp_dim=0)]
        kv = [WeightRule(a + "linear_kv_down_proj.weight", (s + "kv_a_proj_with_mqa.weight",),
                         tp_dim=0),
              WeightRule(a + "kv_layernorm.weight", (s + "kv_a_layernorm.weight",)),
              WeightRule(a + "linear_kv_up_proj.weight", (s + "kv_b_proj.weight",), tp_dim=0)]
        return rules + q + kv


def mla_fields(hf: Mapping[str, Any], family: str, num_heads: int) -> dict[str, Any]:
    """MLATransformerConfig's attention and rope fields of an HF DeepSeek-V3 config; what megatron
    would compute differently is refused by the field's name."""
    if hf.get("attention_bias"):
        raise HFConfigError(f"{family}: attention_bias=true is not supported: megatron-core's "
                            "multi-latent attention projections have no bias")
    kv_heads = hf.get("num_key_value_heads")
    if kv_heads is not None and int(kv_heads) != num_heads:
        raise HFConfigError(f"{family}: num_key_value_heads={kv_heads} with num_attention_heads="
                            f"{num_heads}: multi-latent attention expands its latent into one key "
                            "and value per query head (expected equal)")
    if hf.get("rope_interleave") is False:
        raise HFConfigError(f"{family}: rope_interleave=false is not supported: megatron-core's "
                            "multi-latent attention rotates the rope channels as interleaved pairs "
                            "(rope_utils._apply_rotary_pos_emb_bshd)")
    q_lora = hf.get("q_lora_rank")
    dims = {key: int(require(hf, key, family)) for key in
            ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    for key, value in (("q_lora_rank", q_lora), *dims.items()):
        if value is not None and int(value) <= 0:
            raise HFConfigError(f"{family}: {key}={value}, expected > 0 (q_lora_rank: or null)")
    return dict(
        multi_latent_attention=True,
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=dims["kv_lora_rank"],
        qk_head_dim=dims["qk_nope_head_dim"],
        qk_pos_emb_head_dim=dims["qk_rope_head_dim"],
        v_head_dim=dims["v_head_dim"],
        # What megatron's Attention base class and its local core attention size their output by
        # (attention.py, dot_product_attention.py hidden_size_per_partition): the value heads.
        kv_channels=dims["v_head_dim"],
        # Builds the q and kv latents' RMSNorms (gpt_layer_specs.py: MLA's q_layernorm /
        # kv_layernorm are IdentityOp without it).
        qk_layernorm=True,
        **mla_rope_fields(hf, family, dims["qk_rope_head_dim"]),
    )
