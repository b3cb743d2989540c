"""The weight sync's transports: the one table. A row names a transport's class (a Transport and its
Sender: transport_base.py says what they do), whether it can carry deltas, and how many copies of
the model it keeps in sync.dir.

    row = TRANSPORTS["tensor"]     # TransportRow("tensor", "tensor:TensorTransport", deltas=True)
    transport = make_transport("tensor", pool, ...)   # transport_base.py: the row's class, built

Without deltas every server gets whole tensors on every sync (and a run asking for deltas is
refused at start); the start checks the room of the copies in sync.dir (run/preflight.py). Adding
a transport is a module of its own in this package and one row here (docs/extending.md). This
module imports nothing else (no torch): the run config's `sync.transport` is a Literal of the
table's names and the start checks read its rows before torch loads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class TransportRow:
    name: str
    where: str
    """`module:Class` of its Transport, under gspo_megatron.sync."""
    deltas: bool
    """Whether it can carry deltas (only the changed elements, applied by the project's loader)."""
    folder_versions: int = 0
    """Copies of the model it keeps in sync.dir at once (0: it writes nothing there)."""
    description: str = ""
    """One line for `gspo-megatron config`: how the weights travel, where the servers may be (a row
    is one line, so that a recipe adds one)."""


TRANSPORTS: dict[str, TransportRow] = {row.name: row for row in (
    TransportRow("disk", "disk:DiskTransport", deltas=False, folder_versions=2, description="safetensors files in sync.dir"),
    TransportRow("tensor", "tensor:TensorTransport", deltas=True, description="shared memory on the trainers' hosts"),
    TransportRow("distributed", "distributed:DistributedTransport", deltas=True, description="an update group per server"),
)}
# A Literal of the names, so the config parser names them in its errors.
TransportName = Literal[tuple(TRANSPORTS)]  # type: ignore[valid-type]
