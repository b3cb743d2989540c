"""tools/gpu_check.py's "every Actor closed" row: the device memory still allocated once every
Actor of the check has closed, by what holds it, and what the closes gave back (Actor.released:
actor/release.py's holders).

    row = memory_row(allocated_before, [a.released for a in actors])   # after the last close
    memory_cell(row)                             # the table's cell

What holds the bytes after the last close: tensors the garbage collector can see (the largest
named by shape and dtype), and the rest, which no Python object holds (an allocator-level cache,
a library's own allocation through torch's allocator, such as a workspace the closes missed).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

MIB = 1 << 20
SLACK = 1 << 20  # an allocation or two of the allocator's rounding
"""memory_allocated() may exceed its level before the first Actor by this much and pass."""


def live_device_tensors(device: str) -> list[Any]:
    """Every tensor on `device`'s type ("cuda", "cpu") the collector sees, one per storage."""
    import gc

    import torch
    gc.collect()
    seen: dict[int, Any] = {}
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor) and o.device.type == device:
            seen.setdefault(o.untyped_storage().data_ptr(), o)
    return list(seen.values())


def memory_row(before: int, released: Iterable[dict[str, int]], device: str = "cuda") -> dict[str, Any]:
    """The row once every Actor closed: allocated bytes now against `before` (the level before
    the first), the live tensors and the rest, and the bytes each holder of release.py gave up
    over all the closes (`released`: each Actor's Actor.released)."""
    import torch
    tensors = live_device_tensors(device)  # after a collection: what is left is held
    after = torch.cuda.memory_allocated() if device == "cuda" else 0
    sizes = sorted(((t.untyped_storage().nbytes(), f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}")
                    for t in tensors), reverse=True)
    held = sum(n for n, _ in sizes)
    freed: Counter[str] = Counter()
    for r in released:
        freed.update(r)
    return dict(spec="memory", before=before, after=after, tensors=len(sizes), tensor_bytes=held,
                largest=sizes[:3], other=max(0, after - before - held), freed=dict(freed),
                ok=after <= before + SLACK)


def memory_cell(r: dict[str, Any]) -> str:
    """'memory_allocated B MiB before the first, A MiB after the last (live tensors ...; other
    ...); the closes freed: holder MiB, ...'"""
    largest = ", ".join(f"{shape} {n / MIB:.1f} MiB" for n, shape in r["largest"])
    return (f"memory_allocated {r['before'] / MIB:.1f} MiB before the first, {r['after'] / MIB:.1f} MiB "
            f"after the last (live tensors {r['tensor_bytes'] / MIB:.1f} MiB in {r['tensors']}"
            f"{': ' + largest if largest else ''}; held by no tensor {r['other'] / MIB:.1f} MiB); "
            f"the closes freed: {_freed(r)}")


def memory_key(r: dict[str, Any]) -> str:
    """The short form for scripts/gpu_acceptance.sh's summary: 'A MiB (tensors T MiB, no tensor O
    MiB); the closes freed H MiB, ...' (after-close bytes by what holds them)."""
    return (f"{r['after'] / MIB:.1f} MiB (tensors {r['tensor_bytes'] / MIB:.1f} MiB, no tensor "
            f"{r['other'] / MIB:.1f} MiB); the closes freed {_freed(r)}")


def _freed(r: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in sorted(r["freed"].items(), key=lambda kv: -kv[1])
                     if v) or "nothing"
