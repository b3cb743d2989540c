"""The disk transport: every sender writes its requests as safetensors shards of the version's
folder (`weights-<version>` under sync.dir, a file system the trainer ranks and the servers
share), whole tensors only; rank 0 then writes the folder's index (from the shards' own headers)
and has every server load it with /update_weights_from_disk, which also sets the version. The
previous version's folder is removed once the new one is served: sync.dir holds two copies of
the model at most (the start checks its room: run/preflight.py).

    transport = DiskTransport(pool, sync_dir, hf_path)    # rank 0: config and tokenizer from hf_path

A sync that fails (a full disk included) leaves no `weights-<version>` folder behind: abort()
removes it, the servers keep the version they loaded (paused, until a sync succeeds).
"""
from __future__ import annotations

import itertools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import save_file

from gspo_megatron.checkpoint.hf_files import INDEX_NAME, copy_metadata_files, read_safetensors_header
from gspo_megatron.sync.transport_base import Parts, Sender, SenderState, Transport
from rollout.in_server.weight_loader import PART

if TYPE_CHECKING:
    from rollout.servers.pool import ServerPool


class DiskWriteError(OSError):
    """A shard or the index that could not be written (a full disk, said in one line)."""


def _write(path: Path, write: Callable[[], Any]) -> None:
    try:
        write()
    except (OSError, SafetensorError) as e:
        free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
        raise DiskWriteError(f"writing {path} failed ({e}; {free / 2**20:.1f} MiB free there): free "
                             "space on sync.dir's file system or set sync.dir elsewhere") from None


@dataclass
class DiskSender(Sender[None]):
    """Writes each request of this rank as a shard of the version's folder."""

    folder: str = ""

    def open(self, state: SenderState, targets: dict[str, str]) -> dict[str, Exception]:
        self._shards = itertools.count()
        return {}

    def pack(self, state: SenderState, mode: str, parts: Parts) -> None:
        # mode is "full": a transport without deltas gets no delta targets (weight_sync.py)
        path = Path(self.folder) / f"model-r{dist.get_rank():05d}-{next(self._shards):05d}.safetensors"
        tensors = {n: t for n, t in parts if PART not in n}
        _write(path, lambda: save_file(tensors, str(path), metadata={"format": "pt"}))

    def post(self, state: SenderState, url: str, packed: None) -> list[str]:
        return []  # every server loads the whole folder at finish


class DiskTransport(Transport):
    """Full HF folders under `root`, one per version; `hf_metadata_dir` supplies config.json and
    the tokenizer files."""

    name = "disk"
    sender_type = DiskSender

    @classmethod
    def for_run(cls, pool: ServerPool, *, hf_path: str, sync_dir: Callable[[], Path], **_: Any) -> DiskTransport:
        return cls(pool, sync_dir(), hf_path)

    def __init__(self, pool: ServerPool, root: str | Path, hf_metadata_dir: str | Path) -> None:
        super().__init__(pool)
        self.root, self.metadata_dir = Path(root), Path(hf_metadata_dir)
        # Weight folders a previous (killed) run left behind are never served again: remove them,
        # so that nothing in `root` predates this run.
        for stale in self.root.glob("weights-*"):
            shutil.rmtree(stale, ignore_errors=True)
        self._dir: Path | None = None
        self._current: Path | None = None

    def folder(self, version: str) -> Path:
        return self.root / f"weights-{version}"

    def begin(self, version: str) -> None:
        self._dir = folder = self.folder(version)
        if folder.exists():
            shutil.rmtree(folder)
        _write(folder / "config.json", lambda: copy_metadata_files(self.metadata_dir, folder))

    def sender(self, version: str, targets: dict[str, str]) -> DiskSender:
        return DiskSender(str(self._version_dir()))

    def _version_dir(self) -> Path:
        """The folder of the sync begun last (begin comes first: weight_sync.py)."""
        if self._dir is None:
            raise RuntimeError("the disk transport has no version folder: begin() was not called")
        return self._dir

    def finish(self, version: str) -> None:
        folder = self._version_dir()
        weight_map, total = {}, 0
        for shard in sorted(folder.glob("*.safetensors")):
            header = read_safetensors_header(shard)  # a short shard is named here, not loaded
            weight_map.update({n: shard.name for n in header.tensors})
            total += header.data_bytes
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write(folder / INDEX_NAME,
               lambda: (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n"))
        self.pool.update_weights_from_disk(str(folder), weight_version=version)
        if self._current is not None and self._current != folder:
            shutil.rmtree(self._current, ignore_errors=True)
        self._current = folder

    def abort(self, version: str) -> None:
        """The version's folder goes, unless the servers serve it already."""
        if self._dir is not None and self._dir != self._current:
            shutil.rmtree(self._dir, ignore_errors=True)
