"""Adapters merged into the base: W + scale * B A, on one-process (full) megatron tensors.

    merged = merge_adapters(base_full, adapters_full, scale=settings.scale)

`base_full` is a full state dict (actor/weights/full.py full_state_dict: global names), `adapters_full`
the adapters' (actor/weights/adapter_state.py full_adapter_state_dict): `{module}.lora.a` [r, in] and
`{module}.lora.b` [out, r] for a linear layer, `decoder.layers.{l}.mlp.experts.lora.fc1_a`
[E | 1, r, h], `fc1_b` [E, out, r], `fc2_a` [E, r, ffn], `fc2_b` [E | 1, h, r] for a layer's
routed experts (dim 0 of size 1: shared by every expert, `shared_outer`). The merged dict is what a
dense model holding the adapted policy holds: what the HF export writes and the tests compare with.
"""
from __future__ import annotations

import contextlib
import re
from typing import Iterator, Mapping, Sequence

import torch

from gspo_megatron.lora.adapters import ADAPTER

_LINEAR = re.compile(rf"^(.*)\.{ADAPTER}\.a$")
_EXPERTS = re.compile(rf"^(.*\.mlp\.experts)\.{ADAPTER}\.(fc[12])_a$")


def adapted_weights(adapters: Mapping[str, torch.Tensor], scale: float,
                    num_experts: int) -> dict[str, torch.Tensor]:
    """base weight name -> its delta scale * B A (in float32 of the adapters' values), for every
    adapted weight; routed experts' per global expert (`...local_experts.{e}.linear_fc1.weight`)."""
    deltas: dict[str, torch.Tensor] = {}
    for name in adapters:
        m = _EXPERTS.match(name)
        if m:
            prefix, which = m.groups()
            a, b = adapters[name].float(), adapters[f"{prefix}.{ADAPTER}.{which}_b"].float()
            for e in range(num_experts):
                a_e, b_e = a[e if a.shape[0] > 1 else 0], b[e if b.shape[0] > 1 else 0]
                deltas[f"{prefix}.local_experts.{e}.linear_{which}.weight"] = scale * (b_e @ a_e)
            continue
        m = _LINEAR.match(name)
        if m:
            deltas[f"{m.group(1)}.weight"] = scale * (adapters[f"{m.group(1)}.{ADAPTER}.b"].float()
                                                      @ adapters[name].float())
    return deltas


def merge_adapters(base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor],
                   scale: float, num_experts: int = 0) -> dict[str, torch.Tensor]:
    """`base` with every adapted weight replaced by W + scale * B A, in W's dtype (module docstring).
    A delta for a weight the base does not have is a KeyError naming it."""
    merged = dict(base)
    for name, delta in adapted_weights(adapters, scale, num_experts).items():
        if name not in merged:
            raise KeyError(f"adapter for {name}: the base has no such weight")
        w = merged[name]
        merged[name] = (w.float() + delta).to(w.dtype)
    return merged


def _adapted_weights(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(local base weight, its local delta scale * B A) of every adapter of one unwrapped chunk: a
    column-parallel shard [out/tp, in] gets B's rows times the whole A, a row-parallel one
    [out, in/tp] the whole B times A's columns; expert i of a layer its own B and A."""
    from gspo_megatron.lora.adapters import ExpertLora, LinearLora
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for module in model.modules():
        lora = module._modules.get(ADAPTER)
        if isinstance(lora, LinearLora):
            out.append((getattr(module, "weight"), lora.scale * (lora.b.float() @ lora.a.float())))
        elif isinstance(lora, ExpertLora):
            for which in ("fc1", "fc2"):
                if not lora.has(which):
                    continue
                a, b = getattr(lora, f"{which}_a"), getattr(lora, f"{which}_b")
                for i in range(lora.num_local_experts):
                    local = getattr(module, "local_experts", None)
                    w = (getattr(local[i], f"linear_{which}").weight if local is not None
                         else getattr(getattr(module, f"linear_{which}"), f"weight{i}"))
                    delta = b[i if b.shape[0] > 1 else 0].float() @ a[i if a.shape[0] > 1 else 0].float()
                    out.append((w, lora.scale * delta))
    return out


@contextlib.contextmanager
@torch.no_grad()
def merged_in_place(models: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Inside: every adapted base weight holds W + scale * B A and the adapters are off, so the
    model is the dense policy (what a model-only checkpoint or an HF export of a LoRA run holds);
    after: the base weights are restored bit for bit from copies."""
    from gspo_megatron.lora.attach import adapters_off
    pairs = [p for m in models for p in _adapted_weights(m)]
    saved = [w.detach().clone() for w, _ in pairs]
    try:
        for w, delta in pairs:
            w.copy_((w.float() + delta).to(w.dtype))
        with adapters_off(models):
            yield
    finally:
        for (w, _), old in zip(pairs, saved):
            w.copy_(old)
