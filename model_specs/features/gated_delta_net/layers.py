"""Qwen3-Next's Gated DeltaNet layers in megatron-core (what the fields mean: __init__.py).

    spec = use_gated_delta_net(spec, config, use_te, vp_stage, pp_rank)   # the block's linear layers

megatron-core builds its Gated DeltaNet (megatron/core/ssm/gated_delta_net.py in 0.16.1, a package
of that name in 0.19.2) only inside its experimental block spec, which takes Transformer Engine
alone (experimental_attention_variant_module_specs.py, _get_backend_spec_provider). Here the
family's usual block spec (local or TE) gets the DeltaNet in the layers that
`config.linear_attention_freq` marks, so a Qwen3-Next model runs on the CPU (local spec) as on a GPU:
- local: in_proj a ColumnParallelLinear after the layer's own input norm; TE: a
  TELayerNormColumnParallelLinear with the input norm fused in (the layer's is IdentityOp), as
  megatron's own spec has it. The checkpoint keys are the same (the local layer maps its input
  norm to `self_attention.in_proj.layer_norm_weight`).
- the output norm is a plain RMSNorm (weight * x / rms(x), as HF's Qwen3NextRMSNormGated), not
  zero-centred like every other norm of the model: megatron's spec builds it from the config's
  layernorm_zero_centered_gamma, whose weight would be HF's minus 1, a conversion that is not
  bit-exact both ways.
- `GatedDeltaNetLayout` tags the parameters whose TP shards hold a part of each of several blocks
  of unequal sizes (in_proj: q, k, v, z, beta, alpha; conv1d: q, k, v) with `partition_blocks`,
  which actor/weights/full.py joins and splits by, and gives A_log / dt_bias the partition_dim that
  megatron-core 0.16.1 leaves out.

Without flash-linear-attention (its kernels are Triton: GPU only) megatron-core refuses to build the
layer (HAVE_FLA). On a machine without CUDA, `use_torch_kernels()` gives megatron the torch forms:
its own `torch_chunk_gated_delta_rule` (transformers' reference, which megatron runs under
deterministic_mode), and an l2norm equal to transformers' (modeling_qwen3_next.py, l2norm: x *
rsqrt(sum(x^2) + 1e-6)); `deterministic_mode` (set by the feature there, __init__.py) also takes
the torch convolution (0.16.1 takes it whenever causal_conv1d is absent; 0.19.2 only then).

SGLang's side on a CPU (its Qwen3-Next calls sgl-kernel's CPU ops, built for AMX / AVX-512 only:
the `elif is_cpu():` imports of sglang/srt/layers/attention/linear/kernels/gdn_triton.py and
linear/gdn_backend.py) runs on the torch forms in rollout/in_server/cpu_stand_ins/gdn_ops.py.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import torch

GDN_MODULES = ("megatron.core.ssm.gated_delta_net.common",  # megatron-core 0.19
               "megatron.core.ssm.gated_delta_net")         # megatron-core 0.16


def _gdn_module():
    for name in GDN_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "HAVE_FLA"):
            return mod
    raise ImportError(f"megatron-core has no Gated DeltaNet here (looked for {GDN_MODULES})")


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """transformers' l2norm (modeling_qwen3_next.py), fla's l2norm's math."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def use_torch_kernels() -> None:
    """Let megatron-core build its Gated DeltaNet without flash-linear-attention, with the torch
    forms of its kernels (module docstring). For a machine without CUDA (on CUDA megatron-core's
    own check names flash-linear-attention); idempotent."""
    mod = _gdn_module()
    if mod.HAVE_FLA:  # flash-linear-attention's kernels, or these already in place
        return
    mod.HAVE_FLA = True
    mod.l2norm = l2norm
    # deterministic_mode selects it; also the default where megatron reads the name directly
    mod.chunk_gated_delta_rule = mod.torch_chunk_gated_delta_rule


def gated_delta_net_class() -> type:
    """GatedDeltaNetLayout: megatron-core's GatedDeltaNet with its TP layout tagged."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    class GatedDeltaNetLayout(GatedDeltaNet):
        """megatron-core's GatedDeltaNet; its TP-sharded parameters say how (module docstring)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            qk, v, heads = self.qk_dim, self.v_dim, self.num_value_heads
            blocks = {"in_proj.weight": [qk, qk, v, v, heads, heads],
                      "conv1d.weight": [qk, qk, v], "conv1d.bias": [qk, qk, v]}
            for name, param in self.named_parameters():
                if getattr(param, "tensor_model_parallel", False):
                    param.partition_dim = getattr(param, "partition_dim", 0)
                    param.partition_stride = getattr(param, "partition_stride", 1)
                    if name in blocks:
                        param.partition_blocks = blocks[name]

    return GatedDeltaNetLayout


class GatedOutputNorm(torch.nn.Module):
    """The DeltaNet's output norm on the local spec: weight * x / rms(x), in fp32 as
    transformers' Qwen3NextRMSNormGated normalises (the gate is megatron's to apply)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # each TP rank normalises its own heads with the replicated weight: its gradients are summed
        # over the TP group where sequence parallelism makes megatron do so (norms.py)
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]  # megatron-core reads it; torch's Parameter does not declare it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class TEGatedOutputNorm:
    """The DeltaNet's output norm on the TE spec: TE's RMSNorm without zero-centred gamma."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-6) -> torch.nn.Module:  # type: ignore[misc]  # a factory, as megatron's ModuleSpec calls it: building one returns the norm
        from megatron.core.extensions.transformer_engine import TENorm
        return TENorm(dataclasses.replace(config, layernorm_zero_centered_gamma=False), hidden_size, eps)


def use_gated_delta_net(spec: Any, config: Any, use_te: bool, vp_stage: int | None,
                        pp_rank: int | None) -> Any:
    """A copy of a block spec whose linear-attention layers (config.linear_attention_freq) have
    the Gated DeltaNet in place of self-attention (module docstring)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if not torch.cuda.is_available():
        use_torch_kernels()
    if use_te:
        from megatron.core.extensions.transformer_engine import (TELayerNormColumnParallelLinear,
                                                                 TERowParallelLinear)
        sub = GatedDeltaNetSubmodules(in_proj=TELayerNormColumnParallelLinear,
                                      out_norm=TEGatedOutputNorm, out_proj=TERowParallelLinear)
    else:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        sub = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=GatedOutputNorm,
                                      out_proj=RowParallelLinear)
    gdn = ModuleSpec(module=gated_delta_net_class(), submodules=sub)
    pattern = config.linear_attention_freq
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    layers = []
    for i, layer in enumerate(spec.layer_specs):
        if pattern[offset + i]:
            layer_sub = dataclasses.replace(layer.submodules, self_attention=gdn)
            if use_te:
                layer_sub = dataclasses.replace(layer_sub, input_layernorm=IdentityOp)
            keys = dict(getattr(layer_sub, "sharded_state_dict_keys_map", None) or {})
            if "input_layernorm." in keys:  # the local spec's: the TE key of the fused norm
                keys["input_layernorm."] = "self_attention.in_proj.layer_norm_"
                layer_sub = dataclasses.replace(layer_sub, sharded_state_dict_keys_map=keys)
            layer = dataclasses.replace(layer, submodules=layer_sub)
        layers.append(layer)
    return dataclasses.replace(spec, layer_specs=layers)
