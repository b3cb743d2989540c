"""Atomic step checkpoints with a `latest` pointer, and resume from it.

    ckpt = CheckpointManager("ckpts/run1", keep=2)
    path = ckpt.latest()                                  # None on a fresh run
    if path: loop = ckpt.load(path, chunks, optimizer, scheduler)
    ...
    ckpt.save(step, chunks, optimizer, scheduler, loop)   # collective: every rank calls it

On disk:
    ckpts/run1/step_00000012/   model/       megatron dist_checkpointing (model + optimizer shards,
                                             HF config/tokenizer in model/hf: exportable to HF)
                                driver.json  step, data cursor, partial-rollout buffer, scheduler
                                rng/rank_R.pt
                                COMPLETE     written last, before the rename
    ckpts/run1/latest           "step_00000012" (replaced atomically)

Why a crash at any moment leaves the last complete checkpoint loadable: everything is written into
`step_N.tmp/` and fsynced; rank 0 then writes COMPLETE, renames the directory to `step_N` (atomic on
POSIX) and fsyncs the parent, then replaces `latest` via write-tmp + fsync + os.replace. Before the
rename, `latest` still names the previous step; a leftover `*.tmp` is ignored and deleted by the
next run. Old checkpoints are deleted only after `latest` names the new one.

Model and optimizer use megatron-core dist_checkpointing with the chunks' sharded state dicts, so
a checkpoint saved under one layout loads under another (the distributed optimizer's state is
saved `dp_reshardable`: reshardable over DP only, ENVIRONMENT.md #11).
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from gspo_megatron.checkpoint.loop_state import (LoopState, fsync_dir, fsync_file,
                                                 load_driver_state, load_rng, save_driver_state,
                                                 save_rng)

LATEST = "latest"
COMPLETE = "COMPLETE"
MODEL_DIR = "model"
_STEP_RE = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the path and what is wrong."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# --- model + optimizer via megatron dist_checkpointing ------------------------------------------
def _sharded_state_dict(chunks: list, optimizer, is_loading: bool) -> dict:
    from gspo_megatron.checkpoint.model_io import model_sharded_state_dict
    sd = model_sharded_state_dict(chunks)  # {"model0": ..., ...}: the model checkpoint format
    if optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(
            sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    return sd


def save_model_and_optimizer(path: Path, chunks: list, optimizer, hf_dir: str | None = None) -> None:
    """Collective: every rank writes its shards of the model (+ optimizer) into `path`.

    The model part is exactly model_io's format (with the HF metadata files in path/hf), so
    `step_N/model` also loads with model_io.load_model and exports with convert_megatron_to_hf."""
    from megatron.core import dist_checkpointing

    from gspo_megatron.checkpoint.hf_files import copy_metadata_files
    from gspo_megatron.checkpoint.model_io import HF_SUBDIR, TorchDcpSaveStrategy
    if _rank() == 0:
        path.mkdir(parents=True, exist_ok=False)
        if hf_dir is not None:
            copy_metadata_files(hf_dir, path / HF_SUBDIR)
    _barrier()
    dist_checkpointing.save(_sharded_state_dict(chunks, optimizer, is_loading=False), str(path),
                            sharded_strategy=TorchDcpSaveStrategy())


def _ensure_optimizer_state(optimizer) -> None:
    """A distributed optimizer that has not stepped yet has no state to load into (megatron asserts
    on the missing Adam 'step' without TE/apex): give it dummy state, as megatron does for its
    fsdp path; the load below overwrites all of it, and the model weights too."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(sub, DistributedOptimizer) and not sub.optimizer.state:
            sub._init_optimizer_states_with_dummy_values()


def load_model_and_optimizer(path: Path, chunks: list, optimizer) -> None:
    """Collective: load model (+ optimizer) shards for this rank's layout from `path`."""
    from megatron.core import dist_checkpointing
    if not (path / "metadata.json").is_file():
        raise CheckpointError(f"{path} is not a megatron dist_checkpointing directory "
                              f"(no metadata.json)")
    if optimizer is not None:
        _ensure_optimizer_state(optimizer)
    from gspo_megatron.checkpoint.model_io import (EXTRA_STATE, CheckpointMismatchError,
                                                   check_matches, model_sharded_state_dict)
    check_matches(model_sharded_state_dict(chunks), path)
    state = dist_checkpointing.load(_sharded_state_dict(chunks, optimizer, is_loading=True), str(path))
    for i, c in enumerate(chunks):
        missing, unexpected = c.module.load_state_dict(state[f"model{i}"], strict=False)
        missing = [k for k in missing if not k.endswith(EXTRA_STATE)]
        if missing or unexpected:
            raise CheckpointMismatchError(f"loading {path} into model chunk {i}: missing {missing}, "
                                          f"unexpected {unexpected}")
    if optimizer is not None:
        # The fp32 distributed optimizer copies into leaf params in load_state_dict (ENVIRONMENT #11).
        with torch.no_grad():
            optimizer.load_state_dict(state["optimizer"])
        _unshare_adam_steps(optimizer)


def _unshare_adam_steps(optimizer) -> None:
    """megatron-core 0.16.1 bug (distrib_optimizer.py load_state_dict, non-TE/apex path): one
    `step` tensor object is put into every parameter's Adam state; torch's Adam increments it in
    place once per parameter, so after a resume the bias correction is wrong (the continued run
    drifts by ~lr per step). Give every parameter its own copy."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        for st in getattr(inner, "state", {}).values():
            if isinstance(st, dict) and torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()


# --- the manager ------------------------------------------------------------------------------------
class CheckpointManager:
    def __init__(self, root: str | Path, *, keep: int = 2, hf_dir: str | None = None,
                 save_model: Callable[[Path, list, object], None] | None = None,
                 load_model: Callable[[Path, list, object], None] = load_model_and_optimizer):
        """root: checkpoint.dir. keep: complete checkpoints kept (0 = all). hf_dir: the HF model
        whose config/tokenizer files go with each checkpoint (for export). save_model/load_model:
        the model+optimizer part (collective); the default is megatron dist_checkpointing."""
        self.root = Path(root)
        self.keep = keep
        self._save_model = save_model or (
            lambda path, chunks, opt: save_model_and_optimizer(path, chunks, opt, hf_dir))
        self._load_model = load_model

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
            name = pointer.read_text().strip()
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

    def clean_incomplete(self) -> None:
        """Rank 0: delete `*.tmp` leftovers of a save that was interrupted."""
        if _rank() == 0 and self.root.is_dir():
            for p in self.root.iterdir():
                if p.name.endswith(".tmp"):
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        _barrier()

    # --- save / load -------------------------------------------------------------------------
    def save(self, step: int, chunks: list, optimizer, scheduler, loop: LoopState) -> Path:
        """Collective. Writes step_N atomically and points `latest` at it; returns its path."""
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
        self._save_model(tmp / MODEL_DIR, chunks, optimizer)
        save_rng(tmp, rank)
        if rank == 0:
            if scheduler is not None:
                loop.scheduler = scheduler.state_dict()
            save_driver_state(tmp, loop)
        _barrier()
        _fsync_tree(tmp, only_mine=rank != 0)
        _barrier()
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

    def load(self, path: Path, chunks: list, optimizer, scheduler) -> LoopState:
        """Collective. Restores model, optimizer, scheduler and this rank's RNG; returns the loop state."""
        if not (path / COMPLETE).is_file():
            raise CheckpointError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
        loop = load_driver_state(path)
        self._load_model(path / MODEL_DIR, chunks, optimizer)
        if scheduler is not None and loop.scheduler:
            scheduler.load_state_dict(loop.scheduler)
        load_rng(path, _rank())
        _barrier()
        return loop

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        for s in self.complete_steps()[:-self.keep]:
            shutil.rmtree(self.root / step_dir_name(s), ignore_errors=True)


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
