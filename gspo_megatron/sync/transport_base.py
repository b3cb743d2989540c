"""What a transport of the weight sync is (the table of them: transports.py).

Every sync runs one pass per attempt (weight_sync.py, sender_pass.py), whatever the transport; a
transport is the two parts of it that differ:
- `Transport`, on trainer rank 0, with the servers paused: `begin` opens what the servers need for
  the sync (their update sessions, a folder), `sender` makes the pass's `Sender`, `finish` has the
  servers take the version once every sender is done, `abort` undoes after a failure what would
  stop the next sync (the servers stay paused).
- `Sender`, on every rank that sends (every owner of full tensors, or rank 0 alone with
  sync.senders=rank0): what one sender does with its pending parts. `pack` them once per mode
  ("full": whole tensors, "delta": changed elements in the loader's format), `post` the packed
  parts to each server of that mode (a thread per server). It is a dataclass: rank 0 makes it and
  it reaches the other ranks inside the pass plan, so its fields are what they need of the pass.
  What a sender keeps from one pass to the next (HTTP clients, process groups) is in SenderState.

    transport = make_transport("tensor", pool, hf_path=..., sync_dir=..., master_address=...)
    transport.row          # its TRANSPORTS row (transports.py)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Generic, Sequence, TypeVar

import torch

from gspo_megatron.sync.transports import TRANSPORTS, TransportRow
from gspo_tables import load_object, row_settings

if TYPE_CHECKING:
    from rollout.servers.client import SGLangClient
    from rollout.servers.pool import ServerPool

Parts = Sequence[tuple[str, torch.Tensor]]  # (HF name or a loader entry's name, tensor)
_Kept = TypeVar("_Kept")
_Packed = TypeVar("_Packed")  # what a sender posts: parts, a wire, nothing (disk)


class SenderState:
    """What a rank keeps between passes for its senders: HTTP clients, and what a transport's
    senders keep (kept(): the distributed transport's process groups)."""

    def __init__(self) -> None:
        self.clients: dict[str, SGLangClient] = {}
        self._kept: dict[str, object] = {}

    def client(self, url: str) -> SGLangClient:
        from rollout.servers.client import SGLangClient
        if url not in self.clients:
            self.clients[url] = SGLangClient(url, retries=0)
        return self.clients[url]

    def kept(self, key: str, make: Callable[[], _Kept]) -> _Kept:
        """What a sender keeps on this rank under `key`, made on first use."""
        if key not in self._kept:
            self._kept[key] = make()
        return self._kept[key]  # type: ignore[return-value]


@dataclass
class Sender(Generic[_Packed]):
    """What every sender rank does with its pending parts in one pass (module docstring)."""

    def open(self, state: SenderState, targets: dict[str, str]) -> dict[str, Exception]:
        """Before the pass's first post: get ready for every target (url -> "full" | "delta").
        Returns the servers it could not get ready, with why (ServerUnavailable: lost)."""
        return {}

    def keeps_device(self) -> bool:
        """Its parts may stay on the GPU (it hands device memory to the servers); else the encoder
        puts them on the host."""
        return False

    def pack(self, state: SenderState, mode: str, parts: Parts) -> _Packed:
        """The pending parts of one mode as each server of that mode receives them (once per request)."""
        raise NotImplementedError

    def post(self, state: SenderState, url: str, packed: _Packed) -> list[str]:
        """Deliver `packed` to the server at `url` (from a thread of its own); returns the names
        whose checksum the server found different after applying. A lost server raises
        ServerUnavailable (rollout.servers.client)."""
        raise NotImplementedError

    def close(self, state: SenderState) -> None:
        """After the pass's last post, whether it failed or not."""


class Transport:
    """Trainer rank 0's part of a transport (module docstring); `pool` is the ServerPool."""

    name: ClassVar[str]
    sender_type: ClassVar[type[Sender[Any]]]
    row: TransportRow | None = None
    """Its row of TRANSPORTS (set by make_transport; None for one built by hand)."""

    def __init__(self, pool: ServerPool) -> None:
        self.pool = pool

    @classmethod
    def for_run(cls, pool: ServerPool, *, hf_path: str, sync_dir: Callable[[], Path],
                master_address: str, settings: object = None) -> Transport:
        """The transport of a training run (make_transport): hf_path supplies the model's config
        and tokenizer files, sync_dir() the folder sync.dir names (made on first call),
        master_address trainer rank 0's address as the servers reach it, settings its row's own
        (from sync.transport_args; None for a row without)."""
        return cls(pool)

    def begin(self, version: str) -> None:
        """The servers are paused: open what they need for this sync."""

    def sender(self, version: str, targets: dict[str, str]) -> Sender[Any]:
        """What every sender does in this pass (it travels to them in the pass plan)."""
        return self.sender_type()

    def finish(self, version: str) -> None:
        """Every sender is done: the servers take `version` (and report it)."""
        raise NotImplementedError

    def abort(self, version: str) -> None:
        """After a failure: undo what would stop the next sync (best effort)."""

    def close(self) -> None:
        """At the end of the run."""


def transport_class(name: str) -> type[Transport]:
    """The Transport of the TRANSPORTS row `name` (a row's name or package.module:ROW)."""
    row = TRANSPORTS.row(name, "sync.transport")
    cls = load_object(row.where, f"the {row.name} transport's class")
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise TypeError(f"the {row.name} transport's class {row.where} is not a Transport")
    return cls


def make_transport(name: str, pool: ServerPool, *, hf_path: str, sync_dir: Callable[[], Path],
                   master_address: str, settings: object = None) -> Transport:
    """The transport `name` of TRANSPORTS, built for a training run (Transport.for_run) with its
    row's settings (None: the row's defaults, for a row that has settings)."""
    row = TRANSPORTS.row(name, "sync.transport")
    if settings is None:
        settings = row_settings(row, {}, "sync.transport_args")
    transport = transport_class(name).for_run(pool, hf_path=hf_path, sync_dir=sync_dir,
                                              master_address=master_address, settings=settings)
    transport.row = row
    return transport
