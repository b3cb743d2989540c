"""The tensor transport: each sender posts its requests to every server by shared memory, so the
servers run on the trainer ranks' machines. A request holds the pending parts of one mode as one
flattened tensor (rollout.in_server.weight_loader.flatten), applied by the project's loader
(`load_format` LOADER: whole tensors through the model's own load_weights, deltas written in
place and checksummed), which writes its report (checksum mismatches, errors) to a file the sender
reads after the call. With `cuda_ipc` (TensorSettings) the flattened tensor stays on the sender's
GPU and travels as a CUDA IPC handle: servers on the same GPUs (colocated) read it in place
(rollout.servers.weight_updates.serialize_named_tensors); tools/gpu_check_sync.py checks that path
between two processes on one GPU.

    transport = TensorTransport(pool, cuda_ipc=False)      # rank 0
    # begin: /begin_weight_update on every server; finish: the version through the loader, then
    # /end_weight_update

The distributed transport (distributed.py) opens and ends the servers' sessions the same way.
"""
from __future__ import annotations

import itertools
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from gspo_megatron.sync.transport_base import Parts, Sender, SenderState, Transport
from rollout.in_server.weight_loader import LOADER, PART, flatten, path_tensor

if TYPE_CHECKING:
    from rollout.servers.client import SGLangClient
    from rollout.servers.pool import ServerPool


@dataclass
class TensorSender(Sender[Parts]):
    """Posts each request from this rank by shared memory; the loader's reports come back as files
    in a folder of the pass's own. cuda_ipc: the requests stay on this rank's GPU (IPC handles)."""

    cuda_ipc: bool = False

    def keeps_device(self) -> bool:
        return self.cuda_ipc

    def open(self, state: SenderState, targets: dict[str, str]) -> dict[str, Exception]:
        self._reports = Path(tempfile.mkdtemp(prefix="gspo-sync-report-"))
        self._posted = itertools.count()
        return {}

    def pack(self, state: SenderState, mode: str, parts: Parts) -> Parts:
        return parts  # the loader's format already: each server reads the same shared memory

    def post(self, state: SenderState, url: str, packed: Parts) -> list[str]:
        return post_through_loader(state.client(url), packed, self._reports / f"{next(self._posted)}.json")

    def close(self, state: SenderState) -> None:
        shutil.rmtree(self._reports, ignore_errors=True)


class TensorTransport(Transport):
    """By shared memory: the servers run on the trainer ranks' machines (on their GPUs with
    cuda_ipc)."""

    name = "tensor"
    sender_type: ClassVar[type[Sender[Any]]] = TensorSender

    def __init__(self, pool: ServerPool, cuda_ipc: bool = False) -> None:
        super().__init__(pool)
        self.cuda_ipc = cuda_ipc

    @classmethod
    def for_run(cls, pool: ServerPool, *, settings: object = None, **_: object) -> TensorTransport:
        return cls(pool, cuda_ipc=bool(getattr(settings, "cuda_ipc", False)))

    def sender(self, version: str, targets: dict[str, str]) -> Sender[Any]:
        import torch
        return TensorSender(cuda_ipc=self.cuda_ipc and torch.cuda.is_available())

    def begin(self, version: str) -> None:
        self.pool.for_each(begin_session)

    def finish(self, version: str) -> None:
        set_version(self.pool, version)
        self.pool.for_each(lambda c: c.end_weight_update())


def post_through_loader(client: SGLangClient, parts: Parts, report: Path) -> list[str]:
    """One request through the project's loader; the names whose checksum differed. A loader
    error (it cannot raise: rollout/in_server/weight_loader.py) is raised here."""
    payload = flatten(list(parts) + [(PART + "report", path_tensor(str(report)))])
    client.update_weights_from_tensor(payload, load_format=LOADER, flush_cache=False)
    try:
        got = json.loads(report.read_text())
    except (OSError, ValueError) as e:
        raise RuntimeError(f"{client.url}: the weight loader wrote no report ({e}): is "
                           f"{LOADER} registered (--custom-weight-loader)?") from None
    if got.get("error"):
        raise RuntimeError(f"{client.url}: the weight loader failed: {got['error']}")
    return list(got.get("mismatched", []))


def set_version(pool: ServerPool, version: str) -> None:
    """Every server's weight version, set by a last empty request through the project's loader
    (the senders' requests leave it alone, so a sync that fails part-way keeps the old label)."""
    pool.for_each(lambda c: c.update_weights_from_tensor([], weight_version=version, flush_cache=True,
                                                         load_format=LOADER))


def begin_session(client: SGLangClient) -> None:
    """begin_weight_update; a session left open by a sync that failed between begin and end is
    ended first: SGLang refuses a second one (sglang 0.5 scheduler weight_updater's
    begin_weight_update), so without this a failed sync would block every later one."""
    from rollout.servers.client import SGLangError
    try:
        client.begin_weight_update()
    except SGLangError as e:
        if "already open" not in str(e):
            raise
        client.end_weight_update()
        client.begin_weight_update()
