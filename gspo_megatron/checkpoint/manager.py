"""Atomic step checkpoints with a `latest` pointer, and resume from it.

    ckpt = CheckpointManager("ckpts/run1", keep=2)
    path = ckpt.latest()                 # None on a fresh run
    if path: loop = ckpt.load(path, actor)
    ...
    ckpt.save(step, actor, loop)         # collective: every rank calls it

On disk:
    ckpts/run1/step_00000012/   model/       megatron dist_checkpointing (model + optimizer shards,
                                             HF config/tokenizer in model/hf: exportable to HF)
                                driver.json  step, data cursor, partial-rollout buffer, scheduler
                                rng/rank_R.pt
                                MANIFEST.json  every file, its size and CRC32 (checked on resume;
                                               each rank checksums the files it wrote)
                                COMPLETE     written last, before the rename
    ckpts/run1/latest           "step_00000012" (replaced atomically)

Why a crash at any moment leaves the last complete checkpoint loadable: everything is written into
`step_N.tmp/` and fsynced; rank 0 then writes COMPLETE, renames the directory to `step_N` (atomic on
POSIX) and fsyncs the parent, then replaces `latest` via write-tmp + fsync + os.replace. Before the
rename, `latest` still names the previous step; a leftover `*.tmp` is ignored and deleted by the
next run. Old checkpoints are deleted only after `latest` names the new one.

Model and optimizer use megatron-core dist_checkpointing with the chunks' sharded state dicts, so
a checkpoint saved under one layout loads under another (the distributed optimizer's state is
saved `dp_reshardable`: reshardable over DP only, docs/cpu.md #11).
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import sys
import zlib
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from gspo_megatron.checkpoint.durable import fsync_dir, fsync_file, write_json
from gspo_megatron.checkpoint.hf_files import copy_metadata_files
from gspo_megatron.checkpoint.loop_state import (RNG_DIR, LoopState, load_driver_state, load_rng,
                                                 save_driver_state, save_rng)
from gspo_megatron.checkpoint.model_io import HF_SUBDIR, MANIFEST
from gspo_errors import GspoError

LATEST = "latest"
COMPLETE = "COMPLETE"
MODEL_DIR = "model"
_STEP_RE = re.compile(r"^step_(\d{8})$")


class CheckpointError(GspoError, RuntimeError):
    """A checkpoint that cannot be used; the message names the path and what is wrong."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# --- the manager ------------------------------------------------------------------------------------
class TrainState(Protocol):
    """What a checkpoint holds besides the loop state: the Actor (model, optimizer, schedule)."""

    def save(self, path: Path) -> dict[str, Any]: ...  # collective; returns the scheduler state

    def load(self, path: Path, scheduler_state: dict[str, Any] | None) -> None: ...  # collective


class CheckpointManager:
    def __init__(self, root: str | Path, *, keep: int = 2, hf_dir: str | None = None,
                 checksums: bool = True):
        """root: checkpoint.dir. keep: complete checkpoints kept (0 = all). hf_dir: the HF model
        whose config/tokenizer files go with each checkpoint (model/hf/, for export). checksums:
        record every file's CRC32 in the manifest (checkpoint.verify_checksums)."""
        self.root = Path(root)
        self.keep = keep
        self.hf_dir = hf_dir
        self.checksums = checksums

    # --- discovery ---------------------------------------------------------------------------
    def complete_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        steps = []
        for p in self.root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and (p / COMPLETE).is_file():
                steps.append(int(m.group(1)))
        return sorted(steps)

    def latest(self) -> Path | None:
        """The checkpoint to resume from: what `latest` names (must be complete), else the newest
        complete step directory (a crash between the rename and the pointer update), else None."""
        pointer = self.root / LATEST
        if pointer.is_file():
            try:
                name = pointer.read_bytes().decode("ascii").strip()
            except UnicodeDecodeError:
                raise CheckpointError(f"{pointer} holds non-text bytes, expected a step name like "
                                      f"step_00000010; delete it to resume from the newest complete "
                                      f"step directory") from None
            path = self.root / name
            if not _STEP_RE.match(name):
                raise CheckpointError(f"{pointer} names {name!r}, expected step_NNNNNNNN")
            if not (path / COMPLETE).is_file():
                raise CheckpointError(f"{pointer} names {path}, which is missing or incomplete "
                                      f"(no {COMPLETE} marker); delete the pointer to start over or "
                                      f"point it at a complete step directory")
            newer = [s for s in self.complete_steps() if s > int(name[5:])]
            return self.root / step_dir_name(newer[-1]) if newer else path
        steps = self.complete_steps()
        return self.root / step_dir_name(steps[-1]) if steps else None

    def verify(self, path: Path, *, checksums: bool = True, share: tuple[int, int] = (0, 1)) -> None:
        """CheckpointError naming the first file of `path` that is missing, shorter/longer than
        the manifest written at save time says (a copy or a disk that lost part of it), or, with
        `checksums`, whose bytes changed (its CRC32 differs). share=(rank, world): this process
        reads the checksummed files k with k % world == rank (every rank of a job checks its
        share, in parallel); sizes are checked for all."""
        if not (path / COMPLETE).is_file():
            raise CheckpointError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
        manifest = path / MANIFEST
        if not manifest.is_file():
            return  # saved before manifests existed: COMPLETE is all there is to check
        try:
            data = json.loads(manifest.read_text())
            sizes, crcs = data["files"], data.get("crc32", {})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{manifest} is damaged ({type(e).__name__}: {e})") from None
        self._verify_sizes(path, sizes)
        if checksums:
            rank, world = share
            for k, (rel, want) in enumerate(sorted(crcs.items())):
                f = path / rel
                if k % world != rank or not f.is_file():
                    continue
                if f"{file_crc32(f):08x}" != want:
                    raise CheckpointError(
                        f"checkpoint {path} is damaged: {f} does not match the CRC32 recorded at save "
                        f"(its bytes changed, its size did not); restore the file from a copy, or "
                        f"set checkpoint.verify_checksums=false to resume anyway")

    def _verify_sizes(self, path: Path, sizes: dict[str, int]) -> None:
        for rel, size in sizes.items():
            f = path / rel
            if not f.is_file() and rel.startswith(f"{RNG_DIR}/"):
                continue  # RNG state is optional per rank (load() says which ranks lack it)
            if not f.is_file():
                raise CheckpointError(f"checkpoint {path} is damaged: {f} is missing (the "
                                      f"manifest lists {size} bytes)")
            actual = f.stat().st_size
            if actual != size:
                raise CheckpointError(f"checkpoint {path} is damaged: {f} has {actual} bytes, the "
                                      f"manifest says {size} ({'truncated' if actual < size else 'changed'})")

    def size_bytes(self, path: Path) -> int | None:
        """Total bytes of a checkpoint according to its manifest (None without one)."""
        try:
            return sum(json.loads((path / MANIFEST).read_text())["files"].values())
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def clean_incomplete(self) -> None:
        """Rank 0: delete `*.tmp` leftovers of a save that was interrupted."""
        if _rank() == 0 and self.root.is_dir():
            for p in self.root.iterdir():
                if p.name.endswith(".tmp"):
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        _barrier()

    # --- save / load -------------------------------------------------------------------------
    def save(self, step: int, state: TrainState, loop: LoopState) -> Path:
        """Collective. Writes step_N atomically (the actor's model/optimizer shards, the loop
        state, every rank's RNG) and points `latest` at it; returns its path."""
        rank = _rank()
        final = self.root / step_dir_name(step)
        tmp = self.root / (final.name + ".tmp")
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            if final.exists():  # re-saving a step (e.g. a resumed run redoing it): replace it
                shutil.rmtree(final)
            tmp.mkdir()
        _barrier()
        try:
            loop.scheduler = state.save(tmp / MODEL_DIR)  # collective: fails on every rank

            crcs: dict[str, str] = {}

            def write_mine() -> None:
                save_rng(tmp, rank)
                if rank == 0:
                    if self.hf_dir is not None:
                        copy_metadata_files(self.hf_dir, tmp / MODEL_DIR / HF_SUBDIR)
                    save_driver_state(tmp, loop)
                _fsync_tree(tmp, only_mine=rank != 0)
                if self.checksums:  # each rank its own files, while they are in the page cache
                    crcs.update(_checksums(tmp, rank))
            _on_every_rank(write_mine)
            gathered = _gather(crcs)
            if rank == 0:
                write_manifest(tmp, {k: v for part in gathered for k, v in part.items()}
                               if self.checksums else None)
        except (Exception, CheckpointException) as e:  # a full disk gets its own one-line error
            # (torch's CheckpointException derives from BaseException, not Exception)
            full = self._disk_full_error(e, final.name)
            if full is None:
                raise
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # give the space back; nothing is published
            raise full from e
        if rank == 0:
            (tmp / COMPLETE).write_text(f"{step}\n")
            fsync_file(tmp / COMPLETE)
            fsync_dir(tmp)
            os.rename(tmp, final)
            fsync_dir(self.root)
            pointer_tmp = self.root / (LATEST + ".tmp")
            pointer_tmp.write_text(final.name + "\n")
            fsync_file(pointer_tmp)
            os.replace(pointer_tmp, self.root / LATEST)
            fsync_dir(self.root)
            self._prune()
        _barrier()
        return final

    def load(self, path: Path, state: TrainState) -> LoopState:
        """Collective. Restores model, optimizer, scheduler and this rank's RNG; returns the loop
        state. Checks the files' presence and sizes; their checksums are checked before anything
        starts (the run's preflight.check_inputs: verify(..., share=(rank, world)) on every rank)."""
        self.verify(path, checksums=False)
        loop = load_driver_state(path)
        state.load(path / MODEL_DIR, loop.scheduler)
        found = load_rng(path, _rank())
        # A resume may change the world size: ranks without a saved RNG state keep their seeded one.
        missing = [r for r, ok in enumerate(_gather(found)) if not ok]
        if missing and _rank() == 0:
            try:  # how many ranks saved the checkpoint: the manifest knows, even if files are gone
                listed = json.loads((path / MANIFEST).read_text())["files"]
                saved = sum(1 for rel in listed if rel.startswith(f"{RNG_DIR}/"))
            except (OSError, ValueError, KeyError, TypeError):
                saved = len(list((path / RNG_DIR).glob("rank_*.pt")))
            print(f"gspo-megatron: warning: {path / RNG_DIR} has no RNG state for rank(s) {missing} "
                  f"(the checkpoint was saved by {saved} rank(s)); they continue with freshly "
                  "seeded RNG", file=sys.stderr, flush=True)
        _barrier()
        return loop

    def _disk_full_error(self, error: BaseException, name: str) -> CheckpointError | None:
        """A one-line CheckpointError if `error` came from a full disk, else None.

        torch's writers do not always surface ENOSPC: a short write of torch.save's zip archive
        comes out as "RuntimeError: [enforce fail at inline_container.cc] unexpected pos N vs M".
        So: ENOSPC anywhere in the exception chain, or a short write while the free space is less
        than a checkpoint needs (the previous one's size, else 64 MiB), or almost no space left."""
        enospc, short_write = write_failure_kind(error)
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return None
        previous = [self.size_bytes(self.root / step_dir_name(s)) for s in self.complete_steps()]
        need = next((b for b in reversed(previous) if b), None)
        if not (enospc or free < (1 << 20) or (short_write and free < (need or 64 << 20))):
            return None
        need_text = (f"about {need} bytes needed (the previous checkpoint's size)" if need
                     else "bytes needed unknown")
        return CheckpointError(f"saving checkpoint {name} under {self.root} failed: no space left "
                               f"on device ({free} bytes free, {need_text}); the previous "
                               f"checkpoints are intact, free space and rerun to resume")

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        for s in self.complete_steps()[:-self.keep]:
            shutil.rmtree(self.root / step_dir_name(s), ignore_errors=True)


def write_failure_kind(error: BaseException) -> tuple[bool, bool]:
    """(ENOSPC anywhere in the exception chain, a short write "unexpected pos" in it): what a full
    disk looks like through torch's and dist_checkpointing's writers."""
    chain, seen, enospc, short_write = [error], set(), False, False
    while chain:
        e = chain.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        text = str(e)
        enospc |= (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left" in text
        short_write |= "unexpected pos" in text
        chain += [x for x in (e.__cause__, e.__context__) if x is not None]
        for failure in getattr(e, "failures", {}).values():  # dcp: rank -> (exception, trace)
            chain += [x for x in (failure if isinstance(failure, tuple) else (failure,))
                      if isinstance(x, BaseException)]
    return enospc, short_write


def write_manifest(directory: Path, crc32: dict[str, str] | None = None) -> None:
    """Every file under `directory` with its size, and the CRC32 of each when given (MANIFEST.json),
    for verify() at load time."""
    files = {str(p.relative_to(directory)): p.stat().st_size
             for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST}
    data: dict[str, Any] = {"files": files}
    if crc32 is not None:
        missing = sorted(set(files) - set(crc32))
        if missing:  # a file no rank claimed: checksum it here
            crc32 = {**crc32, **{rel: f"{file_crc32(directory / rel):08x}" for rel in missing}}
        data["crc32"] = {rel: crc32[rel] for rel in files}
    write_json(directory / MANIFEST, data)


def file_crc32(path: Path) -> int:
    """zlib's CRC32 of a file (hardware-assisted: about 6 GB/s on these machines; the disk is
    the limit), read 8 MiB at a time. A checksum against accidents (bit rot, a partial copy,
    bytes overwritten in place), not against tampering."""
    crc = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            crc = zlib.crc32(chunk, crc)
    return crc


def _owner(name: str) -> int:
    """The rank that wrote a checkpoint file: dist_checkpointing's `__R_*.distcp` and
    rng/rank_R.pt name it; the rest (metadata, common.pt, driver.json, hf/) is rank 0's."""
    m = re.match(r"^__(\d+)_.*\.distcp$", name) or re.match(r"^rank_(\d+)\.pt$", name)
    return int(m.group(1)) if m else 0


def _checksums(directory: Path, rank: int) -> dict[str, str]:
    return {str(p.relative_to(directory)): f"{file_crc32(p):08x}"
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST
            and _owner(p.name) == rank}


def _gather(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _on_every_rank(fn) -> None:
    """Run fn on every rank; if it raised anywhere, raise on every rank (no rank is left waiting
    in a barrier for one that failed)."""
    error = None
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - re-raised below on every rank
        error = e
    failed = [(r, m) for r, m in enumerate(_gather(None if error is None else
                                                  f"{type(error).__name__}: {error}")) if m]
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"rank {failed[0][0]} failed writing the checkpoint: {failed[0][1]}")


def _fsync_tree(root: Path, only_mine: bool) -> None:
    """fsync the files under root: all of them (rank 0: it also wrote common.pt / metadata.json),
    or only this rank's (dist_checkpointing's `__R_*.distcp` shards and rng/rank_R.pt): each rank
    makes its own writes durable, in parallel, before rank 0 renames the directory."""
    r = _rank()
    for dirpath, _, files in os.walk(root):
        for name in files:
            if only_mine and not (name.startswith(f"__{r}_") or name == f"rank_{r}.pt"):
                continue
            try:
                fsync_file(os.path.join(dirpath, name))
            except OSError:
                pass
        if not only_mine:
            fsync_dir(dirpath)
