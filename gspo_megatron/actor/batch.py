"""The actor's batch (batch-first `[b, s]`) and its split into data-parallel shards and micro-batches.

Alignment (one convention everywhere in the actor): every per-token tensor is indexed by the
position `t` of the TARGET token. `loss_mask[i, t] = True` means token `tokens[i, t]` is trained,
as predicted by the model from `tokens[i, :t]`; so `loss_mask[:, 0]` is always False (nothing
predicts the first token) and positions `t >= lengths[i]` (right padding) are False.
`rollout_log_probs[i, t]`, `old_log_probs[i, t]`, `ref_log_probs[i, t]` (KL reference),
`weight_versions[i, t]` and, for gspo_token,
`advantages[i, t]` refer to the same token `tokens[i, t]`. The exception is `routed_experts[i, p]`
(MoE routing replay): the engine's top-k experts of each layer for the token at INPUT position p,
which is where a router sees it (-1: no engine routing there). Values at untrained positions are
ignored (the losses mask with torch.where, so even NaN there is harmless). Under context
parallelism a micro-batch holds the rank's chunks at INPUT positions instead (context_chunks).

Splitting: the rollout batch's k mini-batches are consecutive blocks of rows (sizes differ by at
most one); `shard(dp_rank, dp_size, num_mini_batches=k, work=...)` gives each DP rank its part of
EACH mini-batch (balanced by work, balance.py; without `work`, a block of equal row count),
mini-batch 0's rows first, and `shard.mini_batches()`
splits the shard again: so rank r's mini-batch j is exactly its part of the global mini-batch j,
whatever dp_size is, and old log-probs computed on the shard travel with the rows (`select`).
`global_rows` records each row's index in the global batch. `micro_batches()` splits a rank's rows into a
given number of micro-batches; the number must be equal on all ranks (MoE's all-to-all and the
pipeline need it), so a rank with fewer rows gets smaller micro-batches, and a micro-batch left
without rows gets one filler row with an all-False loss mask, which contributes nothing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from gspo_megatron.actor.balance import balanced_sizes, plan_shards, worst_imbalance
from gspo_megatron.parallel import context


@dataclass
class TrainBatch:
    """Rows of token sequences with what the losses need (see the module docstring)."""

    tokens: torch.Tensor                     # [b, s] int64, right-padded
    lengths: torch.Tensor                    # [b] int64, real tokens per row (prompt + response)
    loss_mask: torch.Tensor                  # [b, s] bool, trained target tokens
    advantages: torch.Tensor                 # [b] float (gspo, grpo) or [b, s] (gspo_token)
    rollout_log_probs: torch.Tensor | None = None  # [b, s] float, the engine's log p(tokens[:, t])
    weight_versions: torch.Tensor | None = None    # [b, s] int64, policy version that sampled token t
    old_log_probs: torch.Tensor | None = None      # [b, s] float; set on the LAST pipeline stage
    ref_log_probs: torch.Tensor | None = None      # [b, s] float, KL reference; LAST stage only
    global_rows: torch.Tensor | None = None        # [b] int64, row index in the global batch
    routed_experts: torch.Tensor | None = None     # [b, s, layers, k] int16, engine routing (-1: none)
    teacher_log_probs: torch.Tensor | None = None  # [b, s] float, distillation: log pi_teacher(tokens[:, t])
    mini_batch_sizes: list[int] | None = None      # rows of each mini-batch (set by shard())
    dp_token_imbalance: float | None = None        # set by shard(): max / mean tokens per DP rank,
    # the worst mini-batch

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2:
            raise ValueError(f"tokens must be [b, s], got shape {tuple(self.tokens.shape)}")
        b, s = self.tokens.shape
        for name in ("lengths", "global_rows"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (b,):
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({b},)")
        if self.mini_batch_sizes is not None and sum(self.mini_batch_sizes) != b:
            raise ValueError(f"mini_batch_sizes {self.mini_batch_sizes} do not sum to {b} rows")
        for name in ("loss_mask", "rollout_log_probs", "weight_versions", "old_log_probs",
                     "ref_log_probs", "teacher_log_probs"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (b, s):
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({b}, {s}) like tokens")
        if self.routed_experts is not None and (self.routed_experts.dim() != 4
                                                or tuple(self.routed_experts.shape[:2]) != (b, s)):
            raise ValueError(f"routed_experts has shape {tuple(self.routed_experts.shape)}, expected "
                             f"({b}, {s}, layers, top-k)")
        if tuple(self.advantages.shape) not in ((b,), (b, s)):
            raise ValueError(f"advantages have shape {tuple(self.advantages.shape)}, expected ({b},) "
                             f"or ({b}, {s})")
        self.loss_mask = self.loss_mask.bool()
        if b and (int(self.lengths.min()) < 1 or int(self.lengths.max()) > s):
            raise ValueError(f"lengths must lie in [1, {s}], got min {int(self.lengths.min())} "
                             f"max {int(self.lengths.max())}")
        if b and bool(self.loss_mask[:, 0].any()):
            raise ValueError("loss_mask[:, 0] must be False: no position predicts the first token")
        beyond = torch.arange(s)[None, :] >= self.lengths[:, None]
        if bool((self.loss_mask & beyond).any()):
            raise ValueError("loss_mask is True at a padding position (t >= lengths[i])")

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    def select(self, rows: torch.Tensor | list[int] | slice) -> "TrainBatch":
        """A batch of the given rows (index tensor, list or slice), trimmed to its longest row."""
        if isinstance(rows, list):
            rows = torch.tensor(rows, dtype=torch.long)
        lengths = self.lengths[rows]
        s = int(lengths.max()) if lengths.numel() else 1
        fields = {}
        for f in dataclasses.fields(self):
            t = getattr(self, f.name)
            if t is None or f.name in ("mini_batch_sizes", "dp_token_imbalance"):
                fields[f.name] = None
            elif t.dim() >= 2:
                fields[f.name] = t[rows][:, :s]
            else:
                fields[f.name] = t[rows]
        return TrainBatch(**fields)

    def split(self, sizes: list[int]) -> list["TrainBatch"]:
        """Consecutive blocks of rows of the given sizes (summing to num_rows)."""
        if sum(sizes) != self.num_rows or min(sizes, default=0) < 0:
            raise ValueError(f"split sizes {sizes} must be >= 0 and sum to num_rows={self.num_rows}")
        out, start = [], 0
        for n in sizes:
            out.append(self.select(slice(start, start + n)))
            start += n
        return out

    def shard(self, dp_rank: int, dp_size: int, num_mini_batches: int = 1,
              work: list[float] | None = None) -> "TrainBatch":
        """This data-parallel rank's rows: its part of each of the `num_mini_batches` consecutive
        mini-batches, balanced by `work` (one estimate per row, balance.py) or, without it, by row
        count (see the module docstring); `mini_batches()` splits it again."""
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, {dp_size})")
        plan = plan_shards(self.num_rows, dp_size, num_mini_batches, work)
        rows = [i for parts in plan for i in parts[dp_rank]]
        out = self.select(torch.tensor(rows, dtype=torch.long))
        if self.global_rows is None:
            out.global_rows = torch.tensor(rows, dtype=torch.long)
        out.mini_batch_sizes = [len(parts[dp_rank]) for parts in plan]
        out.dp_token_imbalance = worst_imbalance(self.lengths.tolist(), plan)
        return out

    def mini_batches(self) -> list["TrainBatch"]:
        """The mini-batches of a shard (`shard(..., num_mini_batches=k)`), or [self]."""
        if self.mini_batch_sizes is None:
            return [self]
        return self.split(self.mini_batch_sizes)

    def num_valid_sequences(self) -> int:
        """Rows with at least one trained token (the GSPO mean runs over exactly these)."""
        return int(self.loss_mask.any(dim=1).sum())


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
    packed: "PackedInputs | None" = None       # the model's input as one packed sequence (packing.py)
    targets: torch.Tensor | None = None        # [m, s_m / cp] context parallelism only: see context_chunks

    def to(self, device: torch.device | str) -> "MicroBatch":
        return dataclasses.replace(self, **{
            f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor) or f.name == "packed"
            and getattr(self, f.name) is not None})


def _pad_to(t: torch.Tensor | None, s: int, value=0) -> torch.Tensor | None:
    if t is None or t.dim() < 2 or t.shape[1] == s:
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
        part = batch.select(torch.tensor(rows, dtype=torch.long))
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
        old_log_probs=_pad_to(part.old_log_probs, s),
        rollout_log_probs=_pad_to(part.rollout_log_probs, s),
        ref_log_probs=_pad_to(part.ref_log_probs, s), lengths=lengths,
        routed_experts=_pad_to(part.routed_experts, s, -1))


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

    def to_inputs(t: torch.Tensor | None, fill=0) -> torch.Tensor | None:
        if t is None or t.dim() < 2:
            return t
        return torch.cat([t[:, 1:], t.new_full((t.shape[0], 1, *t.shape[2:]), fill)], dim=1)

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return t if t is None or t.dim() < 2 else context.split(t, rank, size)

    return dataclasses.replace(
        mb, tokens=cut(mb.tokens), position_ids=cut(mb.position_ids), targets=cut(to_inputs(mb.tokens)),
        loss_mask=cut(to_inputs(mb.loss_mask, False)), advantages=cut(to_inputs(mb.advantages)),
        old_log_probs=cut(to_inputs(mb.old_log_probs)),
        rollout_log_probs=cut(to_inputs(mb.rollout_log_probs)),
        ref_log_probs=cut(to_inputs(mb.ref_log_probs)), routed_experts=cut(mb.routed_experts))


def from_input_positions(t: torch.Tensor) -> torch.Tensor:
    """`[m, s]` values at input positions (context_chunks, joined again) back to target
    positions: column t <- column t - 1, column 0 = 0."""
    return torch.cat([torch.zeros_like(t[:, :1]), t[:, :-1]], dim=1)


def pad_to_uniform_shape(mbs: list[MicroBatch]) -> list[MicroBatch]:
    """Pad every micro-batch to the largest rows x seq (filler rows: row index -1, nothing trained),
    for pipelines that run with fixed tensor shapes (variable_seq_lengths=False)."""
    m = max(mb.tokens.shape[0] for mb in mbs)
    s = max(mb.tokens.shape[1] for mb in mbs)

    def grow(t: torch.Tensor | None, value=0) -> torch.Tensor | None:
        if t is None:
            return None
        if t.dim() >= 2:
            t = _pad_to(t, s, value)
        extra = m - t.shape[0]
        return t if extra == 0 else torch.cat([t, t.new_full((extra, *t.shape[1:]), value)])

    return [MicroBatch(index=mb.index, rows=grow(mb.rows, -1), tokens=grow(mb.tokens),
                       position_ids=torch.arange(s).unsqueeze(0).expand(m, s).contiguous(),
                       loss_mask=grow(mb.loss_mask, False), advantages=grow(mb.advantages),
                       old_log_probs=grow(mb.old_log_probs),
                       rollout_log_probs=grow(mb.rollout_log_probs),
                       ref_log_probs=grow(mb.ref_log_probs), lengths=grow(mb.lengths),
                       routed_experts=grow(mb.routed_experts, -1)) for mb in mbs]


def _filler_like(batch: TrainBatch) -> TrainBatch:
    """One row, one token, nothing trained: a placeholder for a micro-batch without rows."""
    def like(t, dtype=None):
        if t is None:
            return None
        return torch.zeros((1,) + (1,) * (t.dim() - 1), dtype=dtype or t.dtype)
    return TrainBatch(tokens=torch.zeros(1, 1, dtype=torch.long), lengths=torch.ones(1, dtype=torch.long),
                      loss_mask=torch.zeros(1, 1, dtype=torch.bool), advantages=like(batch.advantages),
                      rollout_log_probs=like(batch.rollout_log_probs),
                      weight_versions=like(batch.weight_versions),
                      old_log_probs=like(batch.old_log_probs),
                      ref_log_probs=like(batch.ref_log_probs),
                      routed_experts=None if batch.routed_experts is None else torch.full(
                          (1, 1, *batch.routed_experts.shape[2:]), -1, dtype=batch.routed_experts.dtype))
