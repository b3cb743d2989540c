"""How a rank's rows become micro-batches: longest first, filled up to a token budget, and the same
number of micro-batches on every rank.

    plan = plan_micro_batches(batch.lengths.tolist(), max_rows=8, max_tokens=16384, seq_multiple=2)
    plan = split_to_count(plan, agreed_count(len(plan)))   # collective over DP
    mbs = [micro_batch(batch, i, rows, seq_multiple=2) for i, rows in enumerate(plan)]

Why longest first: an unpacked micro-batch is padded to its longest row, so rows of similar length
belong together (RL responses range from a few tokens to the whole budget; in row order a third of
the computed tokens were padding). The budget counts what a micro-batch computes: rows x its
longest row (rounded up to `seq_multiple`), or with packing the rows' lengths summed.

Why the same count: MoE's all-to-all and the pipeline schedule need every rank of a group to run
the same number of micro-batches, and DP ranks may hold different rows. Each rank plans its own
rows, the count is all-reduced (MAX) over the DP group, and a rank below it splits its largest
micro-batches (or adds a filler that trains nothing when every one holds a single row). The loss
scale in steps.py (num_microbatches x dp_size / N) is exact for any grouping.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from gspo_megatron.actor.batching.balance import balanced_sizes
from gspo_megatron.actor.batching.batch import TrainBatch
from gspo_megatron.actor.batching.micro_batch import MicroBatch, micro_batch
from gspo_megatron.actor.batching.packing import pack
from gspo_megatron.parallel.comm import comm_device


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def computed_tokens(lengths: Sequence[int], *, packed: bool, seq_multiple: int = 1) -> int:
    """Tokens a micro-batch of rows with these lengths computes (padding included)."""
    if not lengths:
        return 0
    if packed:
        return _round_up(sum(lengths), seq_multiple)
    return len(lengths) * _round_up(max(lengths), seq_multiple)


def plan_micro_batches(lengths: Sequence[int], *, max_rows: int, max_tokens: int | None = None,
                       seq_multiple: int = 1, packed: bool = False,
                       longest_first: bool = True) -> list[list[int]]:
    """Row indices of each micro-batch: rows sorted longest first (ties by index), each micro-batch
    filled while it has at most `max_rows` rows and computes at most `max_tokens` tokens. At least
    one micro-batch, possibly empty (a rank without rows). longest_first=False without a token
    budget: rows in order, ceil(n / max_rows) micro-batches of equal row counts."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    if not longest_first and max_tokens is None:
        start, out = 0, []
        for n in balanced_sizes(len(lengths), max(1, -(-len(lengths) // max_rows))):
            out.append(list(range(start, start + n)))
            start += n
        return out
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)) if longest_first \
        else list(range(len(lengths)))
    plan: list[list[int]] = []
    for i in order:
        cur = plan[-1] if plan else None
        if cur is not None and len(cur) < max_rows and (max_tokens is None or computed_tokens(
                [int(lengths[j]) for j in cur + [i]], packed=packed, seq_multiple=seq_multiple) <= max_tokens):
            cur.append(i)
        else:
            plan.append([i])
    return plan or [[]]


def split_to_count(plan: list[list[int]], count: int) -> list[list[int]]:
    """`plan` with exactly `count` micro-batches (count >= len(plan)): the micro-batch with the most
    rows is split in two (its longer half first) until there are enough; when every one holds a
    single row, empty (filler) micro-batches make up the rest."""
    if count < len(plan):
        raise ValueError(f"cannot shrink a plan of {len(plan)} micro-batches to {count}")
    plan = [list(p) for p in plan if p] or []
    while len(plan) < count:
        k = max(range(len(plan)), key=lambda j: len(plan[j]), default=None)
        if k is None or len(plan[k]) < 2:
            plan += [[] for _ in range(count - len(plan))]
            break
        rows = plan.pop(k)
        half = (len(rows) + 1) // 2
        plan[k:k] = [rows[:half], rows[half:]]
    return plan


def agreed_count(local: int) -> int:
    """The micro-batch count every rank uses: the largest over the DP group, rounded up to a
    multiple of PP with an interleaved schedule (megatron requires it). Collective over DP."""
    group = ps.get_data_parallel_group()
    need = torch.tensor([max(1, local)], dtype=torch.long, device=comm_device(group))
    dist.all_reduce(need, op=dist.ReduceOp.MAX, group=group)
    n = int(need.item())
    if (ps.get_virtual_pipeline_model_parallel_world_size() or 1) > 1:
        n = _round_up(n, ps.get_pipeline_model_parallel_world_size())
    return n


def build(batch: TrainBatch, *, max_rows: int, max_tokens: int | None, seq_multiple: int,
          packed: bool = False, longest_first: bool = True) -> list[MicroBatch]:
    """This rank's micro-batches (collective over DP for the count)."""
    plan = plan_micro_batches(batch.lengths.tolist(), max_rows=max_rows, max_tokens=max_tokens,
                              seq_multiple=seq_multiple, packed=packed, longest_first=longest_first)
    plan = split_to_count(plan, agreed_count(len([p for p in plan if p])))
    mbs = [micro_batch(batch, i, rows, seq_multiple=1 if packed else seq_multiple)
           for i, rows in enumerate(plan)]
    if packed:
        for mb in mbs:
            mb.packed = pack(mb.tokens, mb.row_lengths(), multiple=seq_multiple)
    return mbs


def model_tokens(mb: MicroBatch) -> int:
    """Tokens the model computes for `mb`: its pack's length, or rows x padded length."""
    return (mb.packed or mb).tokens.numel()


def padding_stats(mbs: Sequence[MicroBatch]) -> tuple[int, int]:
    """(real tokens, computed tokens) of a rank's micro-batches (fillers compute one row)."""
    lengths = [mb.lengths for mb in mbs if mb.lengths is not None]
    real = int(torch.cat(lengths).sum()) if lengths else 0  # one read, not one per micro-batch
    return real, sum(model_tokens(mb) for mb in mbs)
