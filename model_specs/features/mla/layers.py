"""Multi-latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight) on megatron-core's MLASelfAttention.

The mapping (__init__.py; transformers modeling_deepseek_v3.py, DeepseekV3Attention, against
megatron-core 0.16.1 multi_latent_attention.py, MLASelfAttention):

    HF self_attn.*                     megatron self_attention.*      shape
    q_a_proj      (q_lora_rank set)    linear_q_down_proj             [q_lora, h]
    q_a_layernorm                      q_layernorm                    [q_lora]
    q_b_proj                           linear_q_up_proj               [n (nope + rope), q_lora]
    q_proj        (q_lora_rank null)   linear_q_proj                  [n (nope + rope), h]
    kv_a_proj_with_mqa                 linear_kv_down_proj            [kv_lora + rope, h]
    kv_a_layernorm                     kv_layernorm                   [kv_lora]
    kv_b_proj                          linear_kv_up_proj              [n (nope + v), kv_lora]
    o_proj                             linear_proj                    [h, n v]

Every tensor is copied as it is: both sides view q as [.., n, nope + rope] and split it [nope,
rope], the kv latent's output as [kv_lora, rope] and the kv up-projection as [.., n, nope + v]
(MLASelfAttention.get_query_key_value_tensors). The rope channels are rotated in interleaved pairs
on both sides: transformers' apply_rotary_pos_emb_interleave (config.rope_interleave, true by
default and in every published config) and megatron's _apply_rotary_pos_emb_bshd with
multi_latent_attention (t[..., 0::2], t[..., 1::2], then rotate-half), so
q.k is the same sum in the same layout; rope_interleave=false is refused (__init__.py). k's rope
part is one head's, shared by every head, on both sides. The softmax scale and YaRN: features/rope/.

Tensor parallelism: the up-projections and q_proj split their heads (column-parallel), o_proj
its input (row-parallel); the down-projections are whole on every rank (TELinear "duplicated" in
the TE spec, `DuplicatedLinear` in the local one), their weights' gradients summed over TP like
the sequence-parallel norms'. Checkpoint keys agree between the specs: the local spec's MLA
layers save under the TE spec's keys (`mla_te_checkpoint_keys`; the rest: norms.te_checkpoint_keys).
Sequence parallelism is required with TP > 1 (the MLA feature refuses it off): the shared rope
key is gathered over the sequence (in get_query_key_value_tensors), whose backward sums every
rank's heads' gradients; without it each rank would keep its own heads' share.

What megatron-core needs here:
- The local spec's column-parallel down-projections (MLASelfAttention.__init__) lose gradient
  under TP: their output is gathered over TP (get_query_key_value_tensors), and the gather's
  backward keeps this rank's columns of this rank's gradient (mappings.py
  _GatherFromModelParallelRegion), while the rope key's gradient from each rank's heads is only a
  share of it (a GSPO step under TP2 moved linear_kv_down_proj 2.8e-3 away from one process's,
  the log-probs equal). `AdaptedMLASelfAttention` builds them as `DuplicatedLinear`, as the TE
  spec has them.
- 0.19 (mla_qk_norm_config.py, _resolve_mla_qk_layernorm): with qk_layernorm (which builds the
  latents' norms) and q_lora_rank null it puts a norm in front of q_proj, fused in the TE spec
  and refused in the local one ("qk_layernorm requires TransformerEngine"); transformers' q_proj
  (Moonlight, DeepSeek-V2-Lite) takes the layer's normed input as it is. `AdaptedMLASelfAttention`
  builds q_proj without one (0.16.1 never adds one; the override is not called there).
- The local spec's DotProductAttention takes no `k_channels` / `v_channels`, which MLA passes when it builds
  its core attention (MultiLatentAttention.__init__: TypeError in 0.16.1 and 0.19.2).
  `LocalMLACoreAttention` takes them and sizes its output by the value heads.
- 0.16.1 only: multi_latent_attention.py sets its HAVE_TE when megatron's TE extension module
  imports, which it does without Transformer Engine, leaving TELinear a MagicMock; its
  `isinstance(self.linear_proj, TELinear)` in MultiLatentAttention.__init__ then raises
  TypeError. `fix_have_te` sets the flag to what it means (0.19 reads HAVE_TE from the extension
  module itself).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_latent_attention import (MLASelfAttention,
                                                              MLASelfAttentionSubmodules)
from megatron.core.transformer.spec_utils import ModuleSpec

from model_specs.spec_rewrite import rewrite_spec


def fix_have_te() -> bool:
    """Set multi_latent_attention.HAVE_TE to False when its TELinear is not a class (module
    docstring); returns whether it changed anything."""
    if multi_latent_attention.HAVE_TE and not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False
        return True
    return False


FIXED_HAVE_TE = fix_have_te()


class LocalMLACoreAttention(DotProductAttention):
    """megatron's local DotProductAttention with MLA's key and value widths (module docstring):
    keys of k_channels (nope + rope) and values of v_channels, its output [s, b, n/tp x v]."""

    def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if v_channels is not None:  # MLA passes its softmax scale: the head width sizes nothing else
            self.hidden_size_per_attention_head = v_channels
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
        self.k_channels = k_channels


class DuplicatedLinear(MegatronModule):
    """A linear layer whole on every TP rank, without bias: the local spec's counterpart of TE's
    duplicated TELinear. Its weight's gradient is summed over TP under sequence parallelism
    (megatron's finalize_model_grads sums parameters marked `sequence_parallel`), each rank having
    seen its part of the sequence; its checkpoint entry is replicated over TP
    (MegatronModule.sharded_state_dict)."""

    def __init__(self, input_size: int, output_size: int, config: Any) -> None:
        super().__init__(config)
        self.input_size, self.output_size = input_size, output_size
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        if config.perform_initialization:
            with torch.no_grad():
                config.init_method(self.weight)
        self.weight.allreduce = True  # type: ignore[attr-defined]  # megatron-core reads it; torch's Parameter does not declare it
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]  # megatron-core reads it; torch's Parameter does not declare it

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return F.linear(x, self.weight), None  # (output, bias) as megatron's linear layers


class AdaptedMLASelfAttention(MLASelfAttention):
    """MLASelfAttention with whole down-projections in the local spec, and no norm in front of
    q_proj (q_lora_rank null) in either (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name in ("linear_q_down_proj", "linear_kv_down_proj"):
            down = getattr(self, name, None)
            if isinstance(down, ColumnParallelLinear):  # the local spec's; TE's is duplicated
                setattr(self, name, DuplicatedLinear(down.input_size, down.output_size, self.config))

    def _resolve_qk_norm_config(self, submodules: MLASelfAttentionSubmodules) -> dict[str, Any]:
        if self.config.q_lora_rank is not None:
            return super()._resolve_qk_norm_config(submodules)
        kv_norm = submodules.kv_layernorm or IdentityOp  # IdentityOp: fused into kv_up (TE)
        return dict(linear_q_proj=submodules.linear_q_proj, linear_q_up_proj=IdentityOp,
                    linear_kv_up_proj=submodules.linear_kv_up_proj, q_layernorm=IdentityOp,
                    kv_layernorm=kv_norm)


def adapt_mla_spec(spec: Any, *, local: bool, plain_q_proj: bool) -> Any:
    """A copy of a block / layer spec whose MLA layers are AdaptedMLASelfAttention, with
    LocalMLACoreAttention and the TE spec's checkpoint keys in the local spec (`local`), and no
    q_layernorm with q_lora_rank null (`plain_q_proj`)."""
    def adapt(s: Any) -> Any:
        if not (isinstance(s, ModuleSpec) and s.module is MLASelfAttention):
            return None
        sub = s.submodules
        if local:
            if sub.core_attention is not DotProductAttention:
                raise ValueError(f"MLA spec has core attention {sub.core_attention}, expected "
                                 "megatron's local DotProductAttention")
            sub = dataclasses.replace(sub, core_attention=LocalMLACoreAttention)
        if plain_q_proj:
            sub = dataclasses.replace(sub, q_layernorm=IdentityOp)
        return dataclasses.replace(s, submodules=sub, module=AdaptedMLASelfAttention)
    spec = rewrite_spec(spec, adapt)
    return mla_te_checkpoint_keys(spec) if local else spec


def mla_te_checkpoint_keys(spec: Any) -> Any:
    """A copy of a local block spec whose MLA layers save under the keys of the TE spec's MLA layer
    (megatron-core get_gpt_layer_with_transformer_engine_spec, multi_latent_attention; 0.16.1 and
    0.19.2), which megatron's local MLA spec does not map: the latents' norms are fused into the
    up-projections (linear_q_up_proj / linear_kv_up_proj .layer_norm_weight), and a dense layer's
    pre-MLP norm into linear_fc1 (norms.te_checkpoint_keys keeps an MoE layer's its own, as TE
    does); input_layernorm is a norm of its own in both."""
    keys = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
            "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
            "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}

    def mla_layer(s: Any) -> Any:
        attention = getattr(getattr(s, "submodules", None), "self_attention", None)
        if not (isinstance(s, ModuleSpec) and getattr(attention, "module", None) is
                AdaptedMLASelfAttention):
            return None
        return dataclasses.replace(s, submodules=dataclasses.replace(
            s.submodules, sharded_state_dict_keys_map=dict(keys)))
    return rewrite_spec(spec, mla_layer)
