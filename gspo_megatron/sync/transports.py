"""The weight sync's transports: the one table. A row names a transport's class (a Transport and its
Sender: transport_base.py says what they do), whether it can carry deltas, how many copies of the
model it keeps in sync.dir, and its own settings (from sync.transport_args), if any.

    row = TRANSPORTS["tensor"]     # TransportRow("tensor", "gspo_megatron.sync.tensor:TensorTransport", ...)
    transport = make_transport("tensor", pool, ...)   # transport_base.py: the row's class, built

Without deltas every server gets whole tensors on every sync (and a run asking for deltas is
refused at start); the start checks the room of the copies in sync.dir (run/preflight.py). A
transport from outside the package is a TransportRow in an installed module, named
`sync.transport: my_pkg.sync:ROW` or registered by a `plugins:` module (docs/extending.md). This
module imports no torch: the run config checks `sync.transport` against the table and the start
checks read its rows before torch loads.
"""
from __future__ import annotations

from dataclasses import dataclass

from gspo_tables import Table


@dataclass(frozen=True)
class TransportRow:
    name: str
    where: str
    """`package.module:Class` of its Transport (transport_base.Transport)."""
    deltas: bool
    """Whether it can carry deltas (only the changed elements, applied by the project's loader)."""
    folder_versions: int = 0
    """Copies of the model it keeps in sync.dir at once (0: it writes nothing there)."""
    description: str = ""
    """One line for `gspo-megatron config`: how the weights travel, where the servers may be (a row
    is one line, so that a recipe adds one)."""
    settings: type | None = None
    """Its own settings (a dataclass) from sync.transport_args, given to its Transport.for_run;
    None: it takes none."""


@dataclass(frozen=True)
class TensorSettings:
    """The tensor transport's own settings (sync.transport_args)."""

    cuda_ipc: bool = False
    """Hand each request to the servers as CUDA IPC handles to the sender's GPU memory (the
    servers map it, no host copy on either side) instead of host shared memory: for servers on
    the trainers' GPUs (colocated), which must be able to open every sender's GPU. Each sender
    then holds a request's bytes on its GPU while the servers apply it (at most sync.bucket_mb).
    Without CUDA the tensors are on the host already: no effect."""


_S = "gspo_megatron.sync."
TRANSPORTS: Table[TransportRow] = Table("weight-sync transport", TransportRow, (
    TransportRow("disk", _S + "disk:DiskTransport", deltas=False, folder_versions=2, description="safetensors files in sync.dir"),
    TransportRow("tensor", _S + "tensor:TensorTransport", deltas=True,
                 description="shared memory on the trainers' hosts (CUDA IPC with cuda_ipc)", settings=TensorSettings),
    TransportRow("distributed", _S + "distributed:DistributedTransport", deltas=True, description="an update group per server"),
), field="sync.transport")
