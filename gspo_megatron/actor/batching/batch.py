"""The actor's batch (batch-first `[b, s]` padded, or packed: TrainBatch) and its split into
data-parallel shards and mini-batches (micro-batches: micro_batch.py).

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
`global_rows` records each row's index in the global batch.
"""
from __future__ import annotations

import dataclasses
from typing import Any
from dataclasses import dataclass

import torch

from gspo_megatron.actor.batching.balance import balanced_sizes, plan_shards, worst_imbalance  # noqa: F401


# Fields with one value per token ([b, s, ...] padded, [T, ...] packed) and their padding values.
TOKEN_FIELDS = ("tokens", "loss_mask", "rollout_log_probs", "weight_versions", "old_log_probs",
                "ref_log_probs", "routed_experts", "teacher_log_probs")
PAD = {"weight_versions": -1, "routed_experts": -1}
NOT_TENSORS = ("mini_batch_sizes", "dp_token_imbalance", "route_layers")
ROUTE_NONE_U8 = 255  # routed_experts stored compact as uint8 (up to 255 experts): 255 = no routing


def compact_routes(routes: torch.Tensor) -> torch.Tensor:
    """int16 expert ids (-1: none) as uint8 (255: none) when they fit a byte, else as they are."""
    if routes.dtype == torch.uint8 or (routes.numel() and int(routes.max()) >= ROUTE_NONE_U8):
        return routes
    return torch.where(routes < 0, ROUTE_NONE_U8, routes).to(torch.uint8)


def largest_expert_id(routes: torch.Tensor) -> int:
    """The largest expert id the routes name (0 when they name none), in either storage, without a
    widened copy of them (a rank's routes are GiBs at the paper's batch): uint8 in 16M-entry chunks."""
    if routes.dtype != torch.uint8:
        return max(int(routes.max()), 0) if routes.numel() else 0
    flat, hi = routes.reshape(-1), 0
    for start in range(0, flat.numel(), 1 << 24):
        chunk = flat[start:start + (1 << 24)]
        hi = max(hi, int(chunk.masked_fill(chunk == ROUTE_NONE_U8, 0).max()))
    return hi


def positions_in_rows(lengths: torch.Tensor) -> torch.Tensor:
    """Each real token's position in its row, for rows of these lengths laid out one after another
    (the packed form): [0..l0-1, 0..l1-1, ...]."""
    return torch.arange(int(lengths.sum())) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)


def wide_routes(routes: torch.Tensor) -> torch.Tensor:
    """uint8 routes (255: none) back to the actor's int16 (-1: none); int16 as they are."""
    if routes.dtype != torch.uint8:
        return routes
    return torch.where(routes == ROUTE_NONE_U8, -1, routes.to(torch.int16)).to(torch.int16)


@dataclass
class TrainBatch:
    """Rows of token sequences with what the losses need (see the module docstring).

    Two forms. Padded: per-token fields `[b, s, ...]`, right-padded to the longest row (a
    micro-batch's form, and small batches'). Packed (`tokens.dim() == 1`): per-token fields as the
    rows' real tokens concatenated, `[T, ...]` with T = lengths.sum(), row i at
    `offsets[i]:offsets[i + 1]`: the form a rollout batch has from the samples to the micro-batches
    (what a rank holds grows with its rows' real tokens, not with its longest row).
    routed_experts may be stored compact there (uint8, 255 = none; compact_routes). `select`,
    `split`, `shard` and `mini_batches` keep the form; `padded()` gives the padded one.
    """

    tokens: torch.Tensor                     # [b, s] int64, right-padded (packed: [T])
    lengths: torch.Tensor                    # [b] int64, real tokens per row (prompt + response)
    loss_mask: torch.Tensor                  # [b, s] bool, trained target tokens
    advantages: torch.Tensor                 # [b] float (gspo, grpo) or [b, s] (gspo_token; packed [T])
    rewards: torch.Tensor | None = None      # [b] float, the shaped rewards the advantages came from
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
    route_layers: list[int] | None = None          # the global MoE layers of routed_experts' layer
    # axis (a pipeline stage receives only its own); None: every layer, 0..layers-1

    def __post_init__(self) -> None:
        if self.tokens.dim() == 1:
            self._check_packed()
            return
        if self.tokens.dim() != 2:
            raise ValueError(f"tokens must be [b, s] (padded) or [T] (packed), got shape "
                             f"{tuple(self.tokens.shape)}")
        b, s = self.tokens.shape
        self._check_rows(b)
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

    def _check_rows(self, b: int) -> None:
        for name in ("lengths", "global_rows", "rewards"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (b,):
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({b},)")
        if self.mini_batch_sizes is not None and sum(self.mini_batch_sizes) != b:
            raise ValueError(f"mini_batch_sizes {self.mini_batch_sizes} do not sum to {b} rows")
        if (self.routed_experts is not None and self.route_layers is not None
                and len(self.route_layers) != self.routed_experts.shape[-2]):
            raise ValueError(f"route_layers {self.route_layers} name {len(self.route_layers)} layers, "
                             f"routed_experts hold {self.routed_experts.shape[-2]}")

    def _check_packed(self) -> None:
        if self.lengths.dim() != 1:
            raise ValueError(f"lengths has shape {tuple(self.lengths.shape)}, expected (b,)")
        b, total = self.lengths.numel(), int(self.lengths.sum())
        self._check_rows(b)
        if self.tokens.numel() != total:
            raise ValueError(f"packed tokens hold {self.tokens.numel()} tokens, lengths sum to {total}")
        if b and int(self.lengths.min()) < 1:
            raise ValueError(f"lengths must be >= 1, got min {int(self.lengths.min())}")
        for name in TOKEN_FIELDS:
            t = getattr(self, name)
            if t is not None and (t.dim() < 1 or t.shape[0] != total):
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({total}, ...) like the "
                                 "packed tokens")
        if self.routed_experts is not None and self.routed_experts.dim() != 3:
            raise ValueError(f"routed_experts has shape {tuple(self.routed_experts.shape)}, expected "
                             f"({total}, layers, top-k)")
        if tuple(self.advantages.shape) not in ((b,), (total,)):
            raise ValueError(f"advantages have shape {tuple(self.advantages.shape)}, expected ({b},) "
                             f"or ({total},)")
        self.loss_mask = self.loss_mask.bool()
        if b and bool(self.loss_mask[self.offsets[:-1]].any()):
            raise ValueError("loss_mask is True at a row's first token: no position predicts it")

    # --- form -----------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return self.lengths.numel() if self.is_packed else self.tokens.shape[0]

    @property
    def is_packed(self) -> bool:
        return self.tokens.dim() == 1

    @property
    def offsets(self) -> torch.Tensor:
        """Packed: [b + 1], row i at offsets[i]:offsets[i + 1] of every per-token field."""
        return torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(self.lengths, 0)])

    @property
    def padded_shape(self) -> tuple[int, int]:
        """(rows, longest row): the padded form's [b, s]."""
        if not self.is_packed:
            rows, longest = self.tokens.shape
            return rows, longest
        return self.num_rows, (int(self.lengths.max()) if self.num_rows else 1)

    @property
    def route_shape(self) -> tuple[int, int] | None:
        """(layers, top-k) of routed_experts, in either form; None without them."""
        if self.routed_experts is None:
            return None
        layers, top_k = self.routed_experts.shape[-2:]
        return layers, top_k

    def is_token_field(self, name: str) -> bool:
        t = getattr(self, name)
        if name != "advantages":
            return name in TOKEN_FIELDS
        if not self.is_packed:
            return t.dim() == 2
        return t.shape[0] == self.tokens.numel() and t.shape[0] != self.num_rows  # (all 1-token
        # rows: nothing is trained, per row and per token are the same)

    def _row_positions(self, index: torch.Tensor) -> torch.Tensor:
        """Packed: the positions of rows `index`'s real tokens, row after row."""
        lengths = self.lengths[index]
        return torch.repeat_interleave(self.offsets[:-1][index], lengths) + positions_in_rows(lengths)

    def _remade(self, convert, *, keep_split: bool) -> "TrainBatch":
        """A batch of this one's tensor fields as `convert(name, tensor)` gives them; route_layers
        kept, and with keep_split the mini-batch sizes and the DP token imbalance too."""
        out: dict[str, Any] = {"route_layers": self.route_layers}
        if keep_split:
            out.update(mini_batch_sizes=self.mini_batch_sizes, dp_token_imbalance=self.dp_token_imbalance)
        for f in dataclasses.fields(self):
            t = getattr(self, f.name)
            if t is not None and f.name not in NOT_TENSORS:
                out[f.name] = convert(f.name, t)
        return TrainBatch(**out)

    def select(self, rows: torch.Tensor | list[int] | slice) -> "TrainBatch":
        """A batch of the given rows (index tensor, list or slice) in this batch's form; padded:
        trimmed to its longest row."""
        if isinstance(rows, list):
            rows = torch.tensor(rows, dtype=torch.long)
        if self.is_packed:
            if isinstance(rows, slice):
                rows = torch.arange(self.num_rows)[rows]
            flat = self._row_positions(rows)
            return self._remade(lambda name, t: t[flat] if self.is_token_field(name) else t[rows],
                                keep_split=False)
        lengths = self.lengths[rows]
        s = int(lengths.max()) if lengths.numel() else 1
        return self._remade(lambda name, t: t[rows][:, :s] if t.dim() >= 2 else t[rows], keep_split=False)

    def padded(self) -> "TrainBatch":
        """The padded form (self if it is one): each row's tokens at positions 0..length-1, the
        padding's values 0 (-1 for weight versions and routes); compact routes as int16."""
        if not self.is_packed:
            return self
        b, s = self.padded_shape
        real = torch.arange(s)[None, :] < self.lengths[:, None]

        def pad(name: str, t: torch.Tensor) -> torch.Tensor:
            if not self.is_token_field(name):
                return t
            if name == "routed_experts":
                t = wide_routes(t)
            full = t.new_full((b, s, *t.shape[1:]), PAD.get(name, 0))
            full[real] = t
            return full
        return self._remade(pad, keep_split=True)

    def packed(self) -> "TrainBatch":
        """The packed form (self if it is one)."""
        if self.is_packed:
            return self
        real = torch.arange(self.tokens.shape[1])[None, :] < self.lengths[:, None]
        return self._remade(lambda name, t: t[real] if self.is_token_field(name) else t, keep_split=True)

    def row_values(self, name: str, row: int) -> torch.Tensor:
        """The real tokens' values of one row of a per-token field (either form)."""
        t, n = getattr(self, name), int(self.lengths[row])
        if self.is_packed:
            start = int(self.offsets[row])
            return t[start:start + n]
        return t[row, :n]

    def row_sums(self, values: torch.Tensor) -> torch.Tensor:
        """[b] sums over each row's tokens of a per-token tensor of this batch's form."""
        if not self.is_packed:
            return values.sum(dim=1)
        c = torch.cat([values.new_zeros(1), torch.cumsum(values, 0)])
        o = self.offsets
        return c[o[1:]] - c[o[:-1]]

    def token_advantages(self) -> torch.Tensor:
        """The advantages per token ([b, s] or [T]), a per-row advantage on each of its tokens."""
        if self.is_token_field("advantages"):
            return self.advantages
        if self.is_packed:
            return torch.repeat_interleave(self.advantages, self.lengths)
        return self.advantages[:, None].expand(self.tokens.shape)

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
        return int((self.row_sums(self.loss_mask.long()) > 0).sum())

    def nbytes(self) -> int:
        """Bytes of the batch's tensors (what it holds in memory)."""
        return sum(t.numel() * t.element_size() for f in dataclasses.fields(self)
                   if isinstance(t := getattr(self, f.name), torch.Tensor))
