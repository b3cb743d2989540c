"""Weights in batches of bounded size that keep together what must be converted or loaded
together: the checkpoint export's read batches and the weight sync's buckets.

    for batch in weight_batches(plan, lambda e: e.nbytes, 256 << 20, key):   # lists of items

`key(item)` names the group an item belongs to (None: none). A batch closes once the next item
would take it past `max_bytes` (an item larger than that is a batch alone), except inside a
group: from a group's first item to its last, however far apart, no batch is closed, so the
batch grows (a stacked HF tensor of gpt-oss is all of a layer's experts, 4.2 GB in bf16 for
gpt-oss-120b).
"""
from __future__ import annotations

from typing import Callable, Hashable, Iterator, Sequence, TypeVar

T = TypeVar("T")


def weight_batches(items: Sequence[T], nbytes: Callable[[T], int], max_bytes: int,
                   key: Callable[[T], Hashable | None]) -> Iterator[list[T]]:
    """Consecutive batches of `items`, in order (module docstring)."""
    keys = [key(item) for item in items]
    last = {k: i for i, k in enumerate(keys) if k is not None}
    batch: list[T] = []
    size, uncuttable_until = 0, -1
    for i, item in enumerate(items):
        n = nbytes(item)
        if batch and size + n > max_bytes and i > uncuttable_until:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += n
        if keys[i] is not None:
            uncuttable_until = max(uncuttable_until, last[keys[i]])
    if batch:
        yield batch
