"""The lines of a weight map: a megatron parameter name template <-> its HF name templates, and
how the tensors relate. Torch-free plain data: each feature (features/) declares its own.

    WeightRule(L + "self_attention.q_layernorm.weight", (H + "self_attn.q_norm.weight",),
               slot="attention")

Templates use `{layer}` (global layer index) and `{expert}` (global expert index). A rule's `slot`
places it among the others: a model's parameters are listed in HF order (embedding, then each
layer's in slot order, then the final norm and the head), and within a slot in the order the
family's features declared them. maps.py turns a model's rules into its parameters and converts
their tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable

# The kinds: how a megatron tensor relates to its HF tensors (maps.py converts each).
COPY, QKV, GATE_UP, GDN_IN_PROJ = "copy", "qkv", "gate_up", "gdn_in_proj"
# One expert's slice of a stacked HF tensor (features/stacked_experts.py): gate_up_proj [E, h, 2f]
# interleaved, its bias [E, 2f] interleaved, down_proj [E, f, h] (transposed), its bias [E, h].
STACKED_GATE_UP, STACKED_GATE_UP_BIAS, STACKED_T, STACKED = (
    "stacked_gate_up", "stacked_gate_up_bias", "stacked_t", "stacked")
STACKED_KINDS = (STACKED_GATE_UP, STACKED_GATE_UP_BIAS, STACKED_T, STACKED)

SLOTS = ("embedding", "input_norm", "attention", "attention_out", "linear_attention",
         "pre_mlp_norm", "mlp", "router", "experts", "shared_experts", "final_norm", "output")
"""Where a rule's parameter sits in HF order (module docstring)."""

L = "decoder.layers.{layer}."
H = "model.layers.{layer}."


@dataclass(frozen=True)
class WeightRule:
    """One line of the map (module docstring)."""

    megatron: str
    hf: tuple[str, ...]
    kind: str = COPY
    tp_dim: int | None = None
    """Dimension split across tensor-parallel ranks (column-parallel / vocab: 0, row-parallel: 1);
    None = replicated. For experts the split is across the expert-tensor-parallel group."""
    scope: str = "layer"
    """model: once; layer: in every layer of `layers`; expert: for every expert of every layer of
    `layers` (split across expert-parallel ranks)."""
    slot: str = "attention"
    """Where it sits in HF order (SLOTS)."""
    layers: frozenset[int] | None = None
    """The layers that have this parameter (None: all); the MoE feature restricts the dense MLP's
    rules to the dense layers, Gated DeltaNet the attention's to the full-attention layers."""
    layout: tuple[int, ...] = ()
    """The dimensions a fused kind converts by: QKV (heads, query groups, head dim, gated 0/1),
    GDN_IN_PROJ (key heads, key head dim, value heads, value head dim)."""

    def __post_init__(self) -> None:
        if self.slot not in SLOTS or self.scope not in ("model", "layer", "expert"):
            raise ValueError(f"{self.megatron}: slot {self.slot!r} / scope {self.scope!r}, expected "
                             f"one of {SLOTS} / model, layer, expert")


def ordered(rules: Iterable[WeightRule]) -> list[WeightRule]:
    """`rules` in HF order: by slot, and within one in the order given."""
    return sorted(rules, key=lambda r: SLOTS.index(r.slot))


def restricted(rules: Iterable[WeightRule], which: Callable[[WeightRule], bool],
               layers: Iterable[int]) -> list[WeightRule]:
    """`rules` with those `which` selects limited to `layers` (within any limit they had)."""
    keep = frozenset(layers)
    return [replace(r, layers=keep if r.layers is None else r.layers & keep) if which(r) else r
            for r in rules]
