"""DeepSeek-V3 / Kimi-K2 / Moonlight (DeepseekV3ForCausalLM)."""
from __future__ import annotations

from model_specs.families import Family
from model_specs.features.mla import MLA
from model_specs.features.moe import MoE
from model_specs.features.sigmoid_router import SigmoidRouter
from model_specs.hf import tiny

FAMILIES = (
    # Kimi-K2's config says model_type kimi_k2. Multi-latent attention (q through a q_lora_rank
    # bottleneck with an RMSNorm, or one q_proj when q_lora_rank is null as in Moonlight; k and v
    # from one kv_lora_rank latent with an RMSNorm; the last qk_rope_head_dim channels of q and k
    # rotated in interleaved pairs, k's shared by every head), plain RoPE or YaRN with DeepSeek's
    # mscale, then GLM-4.5's MoE: the first `first_k_dense_replace` layers dense, a sigmoid router
    # with the expert bias and group-limited top-k, `routed_scaling_factor`, `n_shared_experts`
    # ungated shared experts. The multi-token-prediction layers are left out as GLM-4.5's are.
    Family("deepseek_v3", ("deepseek_v3", "kimi_k2"),
           (MLA(), MoE(shared_expert="plain"), SigmoidRouter()), tiny=tiny.deepseek_v3),
)
