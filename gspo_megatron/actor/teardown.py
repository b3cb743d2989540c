"""What keeps a dropped Actor's model alive beyond the reach of Python's cycle collector
(Actor.close cuts it, then collects)."""
from __future__ import annotations

import torch

from gspo_megatron.parallel.model_chunks import unwrap


def cut_hidden_references(chunks: list[torch.nn.Module]) -> None:
    """What keeps a dropped Actor's model alive beyond Python's reach (Actor.close). A function of
    its own: its loop variables must be gone before close() collects."""
    for chunk in chunks:
        # A cycle the collector cannot see: megatron's MoE token dispatcher keeps the last
        # forward's routing probs (token_dispatcher.py, `self.probs`), whose autograd graph
        # reaches the router weight's AccumulateGrad node, whose DDP backward hook holds the
        # DDP chunk (C++ edges, not traversed by gc). Without this a trained MoE Actor
        # stayed in memory for good.
        for module in unwrap(chunk).modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            for name, value in list(vars(dispatcher).items()) if dispatcher is not None else ():
                if torch.is_tensor(value):
                    setattr(dispatcher, name, None)
        chunk.grad_accs.clear()
        # megatron caches methods with functools.lru_cache on the class, `self` in the key
        # (RotaryEmbedding.forward in rotary_pos_embedding.py), which holds the module and,
        # through the cached values' graph, the rest. The caches only save recomputation.
        for cls in {c for m in unwrap(chunk).modules() for c in type(m).__mro__}:
            for attr in vars(cls).values():
                if callable(getattr(attr, "cache_clear", None)):
                    attr.cache_clear()
