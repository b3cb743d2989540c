"""Calls made on rank 0 (the driver) whose result, or error, every rank gets.

    held_out = on_driver(rank, lambda: driver.evaluate(step))   # every rank: rank 0's dict
    obj = broadcast_object(obj)                                 # rank 0's object to every rank

A failure on rank 0 raises on every rank (rank 0 the original error, the others DriverError), so
no rank is left waiting in the next collective.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

from gspo_errors import GspoError


class DriverError(GspoError, RuntimeError):
    """Raised on every rank when rank 0 (the driver) failed; the message is rank 0's error, `kind`
    the name of its type, `exit_code` its exit code (every rank exits as rank 0 does)."""

    def __init__(self, message: str, kind: str = "", exit_code: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        if exit_code is not None:
            self.exit_code = exit_code


def on_driver(rank: int, fn: Callable[[], Any]) -> Any:
    """Run fn on rank 0 and broadcast its result to every rank. If it raises on rank 0, every
    rank raises (rank 0 the original error, the others DriverError): no rank is left waiting."""
    result, error = None, None
    if rank == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below after telling the other ranks
            error = e
    payload = broadcast_object(("error", f"{type(error).__name__}: {error}", type(error).__name__,
                                getattr(error, "exit_code", None)) if error else ("ok", result))
    if error is not None:
        raise error
    if payload[0] == "error":
        raise DriverError(f"rank 0 failed: {payload[1]}", payload[2], payload[3])
    return payload[1]


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """`obj` from rank `src` to every rank of the default group (pickled; CPU tensors inside)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]
