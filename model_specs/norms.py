"""Norm modules for the local (non-Transformer-Engine) layer spec.

megatron-core's local spec uses WrappedTorchNorm (transformer/torch_norm.py), which refuses
sequence parallelism (torch_norm.py:32). Sequence parallelism is required for MoE with TP > 1,
and a plain torch RMSNorm is correct under it as long as its weight gradients, which each TP rank
computes from its own sequence chunk, are summed across the TP group: megatron's
finalize_model_grads does that for parameters tagged `sequence_parallel=True`
(distributed/finalize_model_grads.py:354). `SequenceParallelTorchNorm` is that norm; the spec
builder swaps it in for WrappedTorchNorm. With Transformer Engine the TE spec is used instead.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm


def _have_transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or an OSError/RuntimeError without CUDA/cuDNN
        return False
    return torch.cuda.is_available()


HAVE_TE = _have_transformer_engine()


class SequenceParallelTorchNorm:
    """torch.nn.RMSNorm / LayerNorm, usable with sequence parallelism (see module docstring)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                normalization: str = "LayerNorm") -> torch.nn.Module:
        if config.layernorm_zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma is not supported by the torch norm")
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"normalization {config.normalization!r}: expected RMSNorm or LayerNorm")
        if config.sequence_parallel:
            for p in norm.parameters():
                p.sequence_parallel = True
        return norm


def replace_local_norms(spec: Any) -> Any:
    """A copy of a (block / layer / submodule) spec with WrappedTorchNorm swapped for ours."""
    if spec is WrappedTorchNorm:
        return SequenceParallelTorchNorm
    if isinstance(spec, list):
        return [replace_local_norms(s) for s in spec]
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, module=replace_local_norms(spec.module),
                                   submodules=replace_local_norms(spec.submodules))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: replace_local_norms(getattr(spec, f.name))
                   for f in dataclasses.fields(spec) if f.init}
        return dataclasses.replace(spec, **changes)
    return spec
