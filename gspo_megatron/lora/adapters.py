"""The adapters: a low-rank delta beside a frozen megatron linear layer, in the same parallel state
as the layer's own output.

    delta = LinearLora(base, "column", rank=8, scale=2.0)   # then attach.py hooks it to `base`
    out, bias = base(x); out = out + delta(x)               # what the forward hook does

A column-parallel base (linear_qkv, linear_fc1) holds its output rows split over TP: its adapter's
A [r, in] is replicated and B [out/tp, r] is split like the base's rows (the same partition_stride:
a gated fc1 holds [gate_r; up_r] per rank). A row-parallel base (linear_proj, linear_fc2) holds its
input columns split: A [r, in/tp] is split like them, B [out, r] replicated. The rank-r product
crosses the TP ranks through megatron's own region functions (megatron-core
tensor_parallel/mappings.py), r numbers a token instead of the hidden size:

| base | sequence parallel | the r-vector u = A x | A's / B's gradient |
|---|---|---|---|
| column | on | gathered over the sequence (`gather_from_sequence_parallel_region`, backward a reduce-scatter) | A: this rank's tokens only, summed over TP (tagged `sequence_parallel`, summed by finalize_model_grads) |
| column | off | `copy_to_tensor_model_parallel_region` (backward an all-reduce) | exact on every rank |
| row | on | partial sums reduce-scattered over the sequence (`reduce_scatter_to_sequence_parallel_region`) | B: tagged `sequence_parallel` |
| row | off | partial sums all-reduced (`reduce_from_tensor_model_parallel_region`) | exact on every rank |

Routed experts hold one ExpertLora per MoE layer: every local expert's A and B stacked on dim 0
([E_local, r, h] ...), called per expert by SequentialMLP's linears (the local spec, CPU) and per
group of rows by the grouped-GEMM experts (TEGroupedMLP, GPU), so both name and export the same
tensors. With `shared_outer` fc1's A and fc2's B have one slot shared by every expert of the layer
(dim 0 of size 1): SGLang's --experts-shared-outer-loras. Experts run with expert-TP 1 (attach.py
refuses more), so their adapters need no region function; per-expert tensors are reduced over the
expert data-parallel group like the experts' own weights, the shared ones over the dense one.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region,
                                                    reduce_from_tensor_model_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)

ADAPTER = "lora"
"""The child module name every adapter is registered under: `...linear_qkv.lora.a`,
`...mlp.experts.lora.fc1_a`. Parameter and checkpoint keys of adapters hold `.lora.`."""


def is_adapter_key(key: str) -> bool:
    """A parameter, state-dict or checkpoint key of an adapter (never of the base model)."""
    return f".{ADAPTER}." in f".{key}"


def _seeded(seed: int, name: str) -> torch.Generator:
    """A generator that depends on the seed and the tensor's global name only: an adapter starts
    the same under every layout (each rank cuts its shard out of the same full tensor)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:7], "little"))


def init_a(shape: Sequence[int], seed: int, name: str) -> torch.Tensor:
    """A full A [r, in]: uniform in +-1/sqrt(in), torch.nn.Linear's and PEFT's default init
    (kaiming_uniform with a = sqrt(5)), drawn from `_seeded(seed, name)`."""
    bound = 1.0 / math.sqrt(shape[-1])
    return torch.empty(tuple(shape)).uniform_(-bound, bound, generator=_seeded(seed, name))


class LinearLora(torch.nn.Module):
    """The adapter of one column- or row-parallel linear layer (module docstring); call it on the
    layer's input, add the result to the layer's output."""

    def __init__(self, kind: str, *, rank: int, scale: float, in_local: int, out_local: int,
                 sequence_parallel: bool, tp_group: Any, tp_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        if kind not in ("column", "row"):
            raise ValueError(f"kind={kind!r}: expected 'column' or 'row'")
        self.kind, self.scale, self.enabled = kind, scale, True
        self.sequence_parallel, self.tp_group, self.tp_size = sequence_parallel, tp_group, tp_size
        self.a = torch.nn.Parameter(torch.empty(rank, in_local, dtype=dtype, device=device))   # [r, in(/tp)]
        self.b = torch.nn.Parameter(torch.zeros(out_local, rank, dtype=dtype, device=device))  # [out(/tp), r]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = F.linear(x, self.a)                                         # [s(/tp), b, r]
        if self.kind == "column":
            if self.sequence_parallel:
                u = gather_from_sequence_parallel_region(u, True, group=self.tp_group)  # [s, b, r]
            elif self.tp_size > 1:
                u = copy_to_tensor_model_parallel_region(u, group=self.tp_group)
        elif self.sequence_parallel:
            u = reduce_scatter_to_sequence_parallel_region(u, group=self.tp_group)    # [s/tp, b, r]
        elif self.tp_size > 1:
            u = reduce_from_tensor_model_parallel_region(u, group=self.tp_group)
        return F.linear(u, self.b) * self.scale                         # [s(/tp), b, out(/tp)]

    def extra_repr(self) -> str:
        return f"{self.kind}, a={tuple(self.a.shape)}, b={tuple(self.b.shape)}, scale={self.scale:g}"


class ExpertLora(torch.nn.Module):
    """The adapters of one MoE layer's local routed experts (module docstring).

    fc1_a [E | 1, r, h], fc1_b [E, fc1_out, r] (fc1_out: [gate; up] rows of a gated expert),
    fc2_a [E, r, ffn], fc2_b [E | 1, h, r]; the `| 1` with shared_outer. Only the targets'
    tensors exist (linear_fc1 and/or linear_fc2)."""

    def __init__(self, *, layout: str, targets: Sequence[str], num_local_experts: int, hidden: int,
                 ffn: int, fc1_out: int, rank: int, scale: float, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        if layout not in ("per_expert", "shared_outer"):
            raise ValueError(f"layout={layout!r}: expected 'per_expert' or 'shared_outer'")
        self.layout, self.scale, self.enabled = layout, scale, True
        self.num_local_experts = num_local_experts
        outer = 1 if layout == "shared_outer" else num_local_experts
        e = num_local_experts
        if "linear_fc1" in targets:
            self.fc1_a = torch.nn.Parameter(torch.empty(outer, rank, hidden, dtype=dtype, device=device))
            self.fc1_b = torch.nn.Parameter(torch.zeros(e, fc1_out, rank, dtype=dtype, device=device))
        if "linear_fc2" in targets:
            self.fc2_a = torch.nn.Parameter(torch.empty(e, rank, ffn, dtype=dtype, device=device))
            self.fc2_b = torch.nn.Parameter(torch.zeros(outer, hidden, rank, dtype=dtype, device=device))

    def shared(self, name: str) -> bool:
        """Whether tensor `name` (fc1_a, ...) has one slot for every expert of the layer."""
        return self.layout == "shared_outer" and name in ("fc1_a", "fc2_b")

    def has(self, which: str) -> bool:
        return hasattr(self, f"{which}_a")

    def delta(self, which: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert `expert`'s delta for `which` ("fc1" or "fc2") on its rows x [n, in]."""
        a, b = getattr(self, f"{which}_a"), getattr(self, f"{which}_b")
        a_e = a[0 if a.shape[0] == 1 and self.shared(f"{which}_a") else expert]   # [r, in]
        b_e = b[0 if b.shape[0] == 1 and self.shared(f"{which}_b") else expert]   # [out, r]
        return F.linear(F.linear(x, a_e), b_e) * self.scale              # [n, out]

    def grouped_delta(self, which: str, x: torch.Tensor, rows_per_expert: Sequence[int]) -> torch.Tensor:
        """The deltas of a grouped GEMM's input: x [sum(rows), in], expert e's rows consecutive."""
        parts = torch.split(x, list(rows_per_expert))
        return torch.cat([self.delta(which, e, part) for e, part in enumerate(parts)], dim=0)

    def extra_repr(self) -> str:
        shapes = ", ".join(f"{n}={tuple(p.shape)}" for n, p in self.named_parameters(recurse=False))
        return f"{self.layout}, {shapes}, scale={self.scale:g}"
