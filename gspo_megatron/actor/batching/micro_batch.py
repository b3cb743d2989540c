"""A micro-batch as the model consumes it: the rows of a rank's TrainBatch (either form) padded
to their own longest row (micro_batch), split for context parallelism (context_chunks), or padded
to one shape for a fixed-shape pipeline (pad_to_uniform_shape). A micro-batch without rows gets one
filler row with an all-False loss mask, which contributes nothing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from gspo_megatron.actor.batching.balance import balanced_sizes
from gspo_megatron.actor.batching.batch import TrainBatch
from gspo_megatron.parallel import context

if TYPE_CHECKING:
    from gspo_megatron.actor.batching.packing import PackedInputs


@dataclass
class MicroBatch:
    """One micro-batch as the model consumes it (still batch-first; the model transposes)."""

    index: int                               # position in the rank's micro-batch sequence
    rows: torch.Tensor                       # [m] row indices into the rank's TrainBatch (-1 = filler)
    tokens: torch.Tensor                     # [m, s_m]
    position_ids: torch.Tensor               # [m, s_m]
    loss_mask: torch.Tensor                  # [m, s_m] bool
    advantages: torch.Tensor                 # [m] or [m, s_m]
    old_log_probs: torch.Tensor | None       # [m, s_m]
    rollout_log_probs: torch.Tensor | None   # [m, s_m]
    ref_log_probs: torch.Tensor | None = None  # [m, s_m]
    lengths: torch.Tensor | None = None        # [m] real tokens per row (0 for a filler row)
    routed_experts: torch.Tensor | None = None  # [m, s_m, layers, k] engine routing, -1 = none
    packed: PackedInputs | None = None         # the model's input as one packed sequence (packing.py)
    targets: torch.Tensor | None = None        # [m, s_m / cp] context parallelism only: see context_chunks

    def row_lengths(self) -> torch.Tensor:
        """[m] real tokens per row (0 for a filler row): every micro-batch micro_batch() makes has them."""
        if self.lengths is None:
            raise ValueError(f"micro-batch {self.index} carries no row lengths")
        return self.lengths

    def needs(self, name: str) -> torch.Tensor:
        """The per-token field `name` (old_log_probs, ...), which the caller's step cannot run without."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"micro-batch {self.index} carries no {name}")
        return value

    def to(self, device: torch.device | str) -> "MicroBatch":
        return dataclasses.replace(self, **{
            f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor) or f.name == "packed"
            and getattr(self, f.name) is not None})


def _each(t: torch.Tensor | None, f: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """An optional field made the way its required ones are: absent stays absent."""
    return None if t is None else f(t)


def _pad_to(t: torch.Tensor, s: int, value: Any = 0) -> torch.Tensor:
    if t.dim() < 2 or t.shape[1] == s:
        return t
    if t.shape[1] > s:
        return t[:, :s]
    pad = t.new_full((t.shape[0], s - t.shape[1], *t.shape[2:]), value)
    return torch.cat([t, pad], dim=1)


def micro_batches(batch: TrainBatch, num_microbatches: int, *, seq_multiple: int = 1,
                  ) -> list[MicroBatch]:
    """Split a rank's rows into exactly `num_microbatches` micro-batches (see module docstring).

    Each micro-batch is padded to its own longest row, rounded up to `seq_multiple` (the TP size
    under sequence parallelism, which splits the sequence between TP ranks).
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    out, start = [], 0
    for index, n in enumerate(balanced_sizes(batch.num_rows, num_microbatches)):
        out.append(micro_batch(batch, index, list(range(start, start + n)), seq_multiple=seq_multiple))
        start += n
    return out


def micro_batch(batch: TrainBatch, index: int, rows: list[int], *, seq_multiple: int = 1) -> MicroBatch:
    """The micro-batch of the given rows of `batch` (any order), padded to its longest row rounded
    up to `seq_multiple`; no rows: one filler row that trains nothing."""
    if rows:
        part = batch.select(torch.tensor(rows, dtype=torch.long)).padded()
        row_index, lengths = torch.tensor(rows, dtype=torch.long), part.lengths
    else:
        part, row_index = _filler_like(batch), torch.tensor([-1])
        lengths = torch.zeros(1, dtype=torch.long)
    s = -(-part.tokens.shape[1] // seq_multiple) * seq_multiple
    m = part.num_rows
    return MicroBatch(
        index=index, rows=row_index, tokens=_pad_to(part.tokens, s),
        position_ids=torch.arange(s).unsqueeze(0).expand(m, s).contiguous(),
        loss_mask=_pad_to(part.loss_mask, s, False),
        advantages=_pad_to(part.advantages, s),
        old_log_probs=_each(part.old_log_probs, lambda t: _pad_to(t, s)),
        rollout_log_probs=_each(part.rollout_log_probs, lambda t: _pad_to(t, s)),
        ref_log_probs=_each(part.ref_log_probs, lambda t: _pad_to(t, s)), lengths=lengths,
        routed_experts=_each(part.routed_experts, lambda t: _pad_to(t, s, -1)))


def context_chunks(mb: MicroBatch, rank: int, size: int) -> MicroBatch:
    """Context-parallel rank `rank`'s part of a micro-batch (size ranks; s_m a multiple of 2 x size):
    the zig-zag chunks of parallel/context.py of every per-position tensor.

    The model runs on the rank's chunks of tokens and position ids. A target (the next token) can
    lie in another rank's chunk, so the targets are taken BEFORE splitting (`targets[:, p]` =
    tokens[:, p + 1], 0 after the end) and every target-aligned tensor (loss_mask, log-probs,
    token advantages) is moved to the input position that predicts it (column p <- column p + 1;
    column 0, which nothing predicts, drops out) and split alike. So with `targets` set every
    per-position tensor of the micro-batch, and the log-probs of forward.last_stage_log_probs, is
    aligned to INPUT positions; the losses sum over positions and do not care. routed_experts are
    at input positions already. rows and lengths stay whole.
    """
    if mb.packed is not None:
        raise ValueError("packed micro-batches cannot be split for context parallelism")

    def to_inputs(t: torch.Tensor, fill: Any = 0) -> torch.Tensor:
        if t.dim() < 2:
            return t
        return torch.cat([t[:, 1:], t.new_full((t.shape[0], 1, *t.shape[2:]), fill)], dim=1)

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t if t.dim() < 2 else context.split(t, rank, size)

    def cut_inputs(t: torch.Tensor) -> torch.Tensor:
        return cut(to_inputs(t))

    return dataclasses.replace(
        mb, tokens=cut(mb.tokens), position_ids=cut(mb.position_ids), targets=cut(to_inputs(mb.tokens)),
        loss_mask=cut(to_inputs(mb.loss_mask, False)), advantages=cut(to_inputs(mb.advantages)),
        old_log_probs=_each(mb.old_log_probs, cut_inputs),
        rollout_log_probs=_each(mb.rollout_log_probs, cut_inputs),
        ref_log_probs=_each(mb.ref_log_probs, cut_inputs), routed_experts=_each(mb.routed_experts, cut))


def from_input_positions(t: torch.Tensor) -> torch.Tensor:
    """`[m, s]` values at input positions (context_chunks, joined again) back to target
    positions: column t <- column t - 1, column 0 = 0."""
    return torch.cat([torch.zeros_like(t[:, :1]), t[:, :-1]], dim=1)


def pad_to_uniform_shape(mbs: list[MicroBatch]) -> list[MicroBatch]:
    """Pad every micro-batch to the largest rows x seq (filler rows: row index -1, nothing trained),
    for pipelines that run with fixed tensor shapes (variable_seq_lengths=False)."""
    m = max(mb.tokens.shape[0] for mb in mbs)
    s = max(mb.tokens.shape[1] for mb in mbs)

    def grow(t: torch.Tensor, value: Any = 0) -> torch.Tensor:
        if t.dim() >= 2:
            t = _pad_to(t, s, value)
        extra = m - t.shape[0]
        return t if extra == 0 else torch.cat([t, t.new_full((extra, *t.shape[1:]), value)])

    return [MicroBatch(index=mb.index, rows=grow(mb.rows, -1), tokens=grow(mb.tokens),
                       position_ids=torch.arange(s).unsqueeze(0).expand(m, s).contiguous(),
                       loss_mask=grow(mb.loss_mask, False), advantages=grow(mb.advantages),
                       old_log_probs=_each(mb.old_log_probs, grow),
                       rollout_log_probs=_each(mb.rollout_log_probs, grow),
                       ref_log_probs=_each(mb.ref_log_probs, grow), lengths=_each(mb.lengths, grow),
                       routed_experts=_each(mb.routed_experts, lambda t: grow(t, -1))) for mb in mbs]


def _filler_like(batch: TrainBatch) -> TrainBatch:
    """One row, one token, nothing trained: a placeholder for a micro-batch without rows (padded)."""
    def like(name):
        t = getattr(batch, name)
        if t is None:
            return None
        return torch.zeros((1, 1) if batch.is_token_field(name) else (1,), dtype=t.dtype)
    routes, route_shape = None, batch.route_shape
    if route_shape is not None:
        routes = torch.full((1, 1, *route_shape), -1, dtype=torch.int16)
    return TrainBatch(tokens=torch.zeros(1, 1, dtype=torch.long), lengths=torch.ones(1, dtype=torch.long),
                      loss_mask=torch.zeros(1, 1, dtype=torch.bool), advantages=like("advantages"),
                      rollout_log_probs=like("rollout_log_probs"), weight_versions=like("weight_versions"),
                      old_log_probs=like("old_log_probs"), ref_log_probs=like("ref_log_probs"),
                      routed_experts=routes, route_layers=batch.route_layers)
