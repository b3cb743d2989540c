"""The local (non-Transformer-Engine) layer spec's adjustments: norms usable with sequence
parallelism, and checkpoint keys equal to the TE spec's.

megatron-core's local spec uses WrappedTorchNorm (transformer/torch_norm.py), which refuses
sequence parallelism (in its __new__). Sequence parallelism is required for MoE with TP > 1,
and a plain torch RMSNorm is correct under it as long as its weight gradients, which each TP rank
computes from its own sequence chunk, are summed across the TP group: megatron's
finalize_model_grads does that for parameters tagged `sequence_parallel=True`
(its _allreduce_non_tensor_model_parallel_grads). `SequenceParallelTorchNorm` is that norm; the spec
builder swaps it in for WrappedTorchNorm. With Transformer Engine the TE spec is used instead.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from model_specs.spec_rewrite import rewrite_spec


def _have_transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or an OSError/RuntimeError without CUDA/cuDNN
        return False
    return torch.cuda.is_available()


HAVE_TE = _have_transformer_engine()


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm with a zero-centred weight: x / rms(x) * (1 + weight), computed in fp32 as
    transformers' Qwen3NextRMSNorm computes it (modeling_qwen3_next.py, Qwen3NextRMSNorm), which
    is TE's RMSNorm with zero_centered_gamma. The weight starts at 0, the identity."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class SequenceParallelTorchNorm:
    """torch.nn.RMSNorm / LayerNorm (or ZeroCenteredRMSNorm), usable with sequence parallelism
    (see module docstring)."""

    # a factory, as megatron's ModuleSpec calls it: building one returns the norm, not this class
    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,  # type: ignore[misc]
                persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                normalization: str = "LayerNorm") -> torch.nn.Module:
        norm: torch.nn.Module
        if config.layernorm_zero_centered_gamma and config.normalization != "RMSNorm":
            raise ValueError("layernorm_zero_centered_gamma: the torch norm has it for RMSNorm only")
        if config.layernorm_zero_centered_gamma:
            norm = ZeroCenteredRMSNorm(hidden_size, eps, config.params_dtype)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"normalization {config.normalization!r}: expected RMSNorm or LayerNorm")
        if config.sequence_parallel:
            for p in norm.parameters():
                p.sequence_parallel = True  # type: ignore[attr-defined]  # megatron-core reads it; torch's Parameter does not declare it
        return norm


def replace_local_norms(spec: Any) -> Any:
    """A copy of a (block / layer / submodule) spec with WrappedTorchNorm swapped for ours."""
    return rewrite_spec(spec, lambda s: SequenceParallelTorchNorm if s is WrappedTorchNorm else None)


def te_checkpoint_keys(spec: Any) -> Any:
    """A copy of a local block spec whose MoE layers save their pre-MLP norm under the TE spec's
    checkpoint key.

    megatron-core's local layer spec renames norms in its sharded state dict to the fused TE names
    (gpt_layer_specs.py, get_gpt_layer_local_spec: sharded_state_dict_keys_map, 0.16.1 and 0.19.2):
    input_layernorm -> self_attention.linear_qkv.layer_norm_weight, pre_mlp_layernorm ->
    mlp.linear_fc1.layer_norm_weight. In an MoE layer the TE spec does not fuse the pre-MLP norm
    (the experts are not one LayerNormLinear) and saves it as pre_mlp_layernorm.weight, so a
    local-spec MoE checkpoint did not load into a TE-spec model (recorded on an H100:
    tests/data/param_names). Dropping that one rename for MoE layers makes the two specs'
    checkpoint keys identical (tests/model_specs/test_spec_names.py). A feature whose layers the
    local spec maps otherwise sets their keys itself (features/mla/layers.py, features/
    gated_delta_net/layers.py)."""
    if isinstance(spec, list):
        return [te_checkpoint_keys(s) for s in spec]
    if isinstance(spec, ModuleSpec):
        sub = spec.submodules
        keys = getattr(sub, "sharded_state_dict_keys_map", None)
        if keys and "pre_mlp_layernorm." in keys and _is_moe_mlp(getattr(sub, "mlp", None)):
            keys = {k: v for k, v in keys.items() if k != "pre_mlp_layernorm."}
            sub = dataclasses.replace(sub, sharded_state_dict_keys_map=keys)
            return dataclasses.replace(spec, submodules=sub)
        return spec
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type) and hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=te_checkpoint_keys(spec.layer_specs))
    return spec


def _is_moe_mlp(mlp: Any) -> bool:
    # A ModuleSpec (megatron-core 0.16) or a functools.partial of the module (0.19)
    module = getattr(mlp, "module", None) or getattr(mlp, "func", None)
    return getattr(module, "__name__", "") == "MoELayer"
