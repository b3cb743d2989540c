"""Data-parallel shards balanced by work: each mini-batch's rows partitioned over the DP ranks so
that every rank computes about the same, whatever the lengths.

RL responses are long-tailed (a few 20-32k-token rows among 1-2k ones). Cut by row count, one DP
rank gets the long rows and every other rank waits for it at the gradient reduction. Here the
rows of each mini-batch go to the ranks by the Karmarkar-Karp largest differencing method
(multi-way), on an estimate of each row's work:

    tokens: L                                   (the rows' real tokens, prompt + response)
    flops:  L x (P + layers x q_width x L)      (6 P FLOPs per token for the weights, forward +
                                                 backward, plus causal attention's 6 layers q_width
                                                 L^2; the common factor 6 dropped)
    rows:   consecutive blocks of equal row counts (the layout before this module)

with P the parameters one token passes through (model_specs.param_count's active count) and
q_width = heads x head_dim. At Qwen3-30B-A3B's shape the quadratic term equals the linear one at
L ~ 17k tokens, so at 32k "tokens" under-weights the longest rows by about 3x; hence flops is the
default (train.dp_balance).

The partition is a pure function of the lengths (ties broken by row index): every rank computes
the same one from the same batch, and a resumed run the same as the run it resumes. The losses
normalise by global counts (steps.py), so any partition gives the one-process loss and gradients.

    parts = karmarkar_karp([5.0, 4, 3, 3, 2, 1], 2)     # [[0, 3, 5], [1, 2, 4]]: sums 9 and 9
"""
from __future__ import annotations

import heapq
from typing import Callable, Sequence

BALANCE_MODES = ("flops", "tokens", "rows")


def balanced_sizes(n: int, parts: int) -> list[int]:
    """n split into `parts` sizes differing by at most one, larger first."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def karmarkar_karp(work: Sequence[float], parts: int) -> list[list[int]]:
    """The indices of `work` in `parts` subsets of nearly equal sums (largest differencing method:
    repeatedly merge the two partial partitions whose spread is largest, pairing the heavier
    subsets of one with the lighter ones of the other). Each subset's indices ascend; subsets are
    ordered by decreasing sum, ties by their smallest index. O(n parts log(n parts))."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if parts == 1:
        return [list(range(len(work)))]
    # A partial partition: `parts` (sum, indices) subsets, heaviest first.
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for i, w in enumerate(work):
        if w < 0:
            raise ValueError(f"work[{i}] = {w}: expected >= 0")
        subsets = [(float(w), [i])] + [(0.0, []) for _ in range(parts - 1)]
        heapq.heappush(heap, (-float(w), i, subsets))
    while len(heap) > 1:
        _, order_a, a = heapq.heappop(heap)
        _, order_b, b = heapq.heappop(heap)
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda s: (-s[0], min(s[1], default=len(work))))
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), min(order_a, order_b), merged))
    subsets = heap[0][2] if heap else [(0.0, []) for _ in range(parts)]
    return [sorted(ix) for _, ix in subsets]


def model_work(spec, mode: str) -> Callable[[list[int]], list[float]] | None:
    """The per-row work estimate of `mode` for a model (a ModelSpec or a ModelShape), or None
    for "rows" (cut by row count)."""
    if mode == "rows":
        return None
    from model_specs.param_count import param_count
    c = spec.config
    active, width = param_count(spec).active, c.num_layers * c.num_attention_heads * c.kv_channels
    return lambda lengths: row_work(lengths, mode, active_params=active, attention_width=width)


def row_work(lengths: Sequence[int], mode: str, *, active_params: int = 0,
             attention_width: int = 0) -> list[float]:
    """Each row's work estimate (module docstring); attention_width = layers x heads x head_dim."""
    if mode == "tokens":
        return [float(n) for n in lengths]
    if mode == "flops":
        if active_params <= 0:
            raise ValueError("dp_balance=flops needs the model's active parameter count")
        return [float(n) * (active_params + attention_width * float(n)) for n in lengths]
    raise ValueError(f"dp_balance={mode!r}: expected one of {BALANCE_MODES}")


def token_imbalance(lengths: Sequence[int], parts: list[list[int]]) -> float:
    """max over mean of the tokens per part (1.0 = perfectly even; an empty batch is even)."""
    tokens = [sum(int(lengths[i]) for i in part) for part in parts]
    mean = sum(tokens) / len(tokens) if tokens else 0.0
    return max(tokens) / mean if mean > 0 else 1.0


def worst_imbalance(lengths: Sequence[int], plan: list[list[list[int]]]) -> float:
    """token_imbalance of a plan_shards plan's worst mini-batch (batch/dp_token_imbalance)."""
    return max((token_imbalance(lengths, parts) for parts in plan), default=1.0)


def plan_shards(num_rows: int, dp_size: int, num_mini_batches: int,
                work: Sequence[float] | None = None) -> list[list[list[int]]]:
    """[mini-batch][dp rank] -> the global rows that rank trains in that mini-batch. Mini-batch j
    is the j-th consecutive block of rows (sizes differ by at most one) whatever dp_size is; with
    `work` its rows are partitioned by karmarkar_karp, else cut into consecutive blocks of equal
    row counts (the "rows" mode)."""
    if not 1 <= num_mini_batches <= max(num_rows, 1):
        raise ValueError(f"num_mini_batches must be in [1, {num_rows}] (rows), got {num_mini_batches}")
    if work is not None and len(work) != num_rows:
        raise ValueError(f"work has {len(work)} entries for {num_rows} rows")
    plan, start = [], 0
    for n in balanced_sizes(num_rows, num_mini_batches):
        if work is None:
            parts, first = [], start
            for size in balanced_sizes(n, dp_size):
                parts.append(list(range(first, first + size)))
                first += size
        else:
            parts = [[start + i for i in part] for part in karmarkar_karp(work[start:start + n], dp_size)]
        plan.append(parts)
        start += n
    return plan
