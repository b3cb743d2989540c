"""The model chunks of a rank: megatron GPTModels inside DDP / Float16Module wrappers."""
from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel


def unwrap(chunk: torch.nn.Module) -> GPTModel:
    """The GPTModel inside DDP / Float16Module wrappers (their parameter names carry 'module.')."""
    while not isinstance(chunk, GPTModel):
        if not hasattr(chunk, "module"):
            raise TypeError(f"expected a (wrapped) GPTModel, got {type(chunk).__name__}")
        inner = chunk.module
        if not isinstance(inner, torch.nn.Module):
            raise TypeError(f"{type(chunk).__name__}.module is a {type(inner).__name__}, not a module")
        chunk = inner
    return chunk
