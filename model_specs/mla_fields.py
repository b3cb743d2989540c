"""The TransformerConfig fields of multi-latent attention (DeepSeek-V3's MLA): plain numbers,
torch-free, so that shape.py (the planner) reads the same mapping as the built model. What the
fields mean and the megatron-core lines they match: mla.py's docstring.

    fields = mla_fields(hf, "deepseek_v3", num_heads=128)
    fields["q_lora_rank"], fields["qk_pos_emb_head_dim"], fields["rope_type"]   # 1536, 64, "yarn"
"""
from __future__ import annotations

from typing import Any, Mapping

from model_specs.hf.config import HFConfigError, require
from model_specs.rope import mla_rope_fields


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
                            "(rope_utils.py:116)")
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
