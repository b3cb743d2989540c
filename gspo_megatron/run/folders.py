"""The folders a run writes and owns: which they are (by config field), the scratch directory every
rank can see, and the locks that make a folder one run's.

    scratch_dir(cfg, "logs")              # under checkpoint.dir (else the TensorBoard dir, ./runs)
    locks = lock_run_folders(cfg)         # rank 0: RunLockedError if another run holds one
    release(locks)
    set_aside_earlier_files(cfg)          # rank 0, a fresh start: an earlier attempt's metrics moved
    drop_records_from(cfg, step)          # rank 0, a resume: the records of steps it redoes dropped

What must hold of them before a run starts (writable, room, a harmless export target, unlocked) is
checked in preflight.py.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from gspo_megatron.checkpoint.output_dirs import OutputDirError
from gspo_megatron.checkpoint.run_lock import RunLock, check_unlocked
from gspo_megatron.config import RunConfig

# Scratch folders of a run (scratch_dir): the initial HF -> megatron conversion, the KL reference.
INITIAL_DIR = "initial_megatron"
REFERENCE_DIR = "reference"


def run_root(cfg: RunConfig) -> str:
    """Where the run's scratch state lives (scratch_dir's root)."""
    return cfg.checkpoint.dir or cfg.logging.tensorboard_dir or "runs"


def scratch_dir(cfg: RunConfig, name: str, create: bool = True) -> Path:
    """A directory every rank can see: under checkpoint.dir when set (shared storage on a
    cluster), else under the TensorBoard dir, else ./runs. Created unless create=False (then
    its parent is)."""
    path = Path(run_root(cfg)) / name
    (path if create else path.parent).mkdir(parents=True, exist_ok=True)
    return path


def output_fields(cfg: RunConfig) -> dict[str, str]:
    """Config field -> folder the run writes into (files: their folder)."""
    out = {"checkpoint.dir": cfg.checkpoint.dir, "logging.tensorboard_dir": cfg.logging.tensorboard_dir,
           "sync.dir": cfg.sync.dir}
    for field, path in (("logging.metrics_jsonl", cfg.logging.metrics_jsonl),
                        ("logging.rollout_records", cfg.logging.rollout_records)):
        if path:
            if Path(path).is_dir():
                raise OutputDirError(f"{field}={path!r} is a directory; it names a file to append to")
            out[field] = str(Path(path).parent)
    if not (cfg.checkpoint.dir or cfg.logging.tensorboard_dir):
        out["(run folder)"] = run_root(cfg)
    return {k: v for k, v in out.items() if v}


def export_rules(cfg: RunConfig) -> dict[str, dict[str, str | None]]:
    """What checkpoint.export_hf must not be, be inside of, or contain: the inputs; what it must
    not be or contain, though it may lie inside: the run's folders (output_dirs)."""
    return dict(protected={"model.hf_path": cfg.model.hf_path,
                           "model.megatron_checkpoint": cfg.model.megatron_checkpoint},
                may_hold={"checkpoint.dir": cfg.checkpoint.dir,
                          "logging.tensorboard_dir": cfg.logging.tensorboard_dir})


def lock_folders(cfg: RunConfig) -> dict[str, str]:
    """Config field -> folder a run locks: checkpoint.dir and logging.tensorboard_dir (or the run
    folder), each folder once."""
    folders = {"checkpoint.dir": cfg.checkpoint.dir, "logging.tensorboard_dir": cfg.logging.tensorboard_dir}
    if not any(folders.values()):
        folders = {"(run folder)": run_root(cfg)}
    out: dict[str, str] = {}
    for field, folder in folders.items():
        if folder and Path(folder).resolve() not in {Path(f).resolve() for f in out.values()}:
            out[field] = folder
    return out


def check_run_folders_unlocked(cfg: RunConfig) -> None:
    """Rank 0, before torch: RunLockedError naming the holder when a live run holds a folder."""
    for field, folder in lock_folders(cfg).items():
        check_unlocked(folder, field)


def lock_run_folders(cfg: RunConfig) -> list[RunLock]:
    """Rank 0: lock checkpoint.dir and logging.tensorboard_dir (or the run folder); all or none."""
    locks: list[RunLock] = []
    try:
        for field, folder in lock_folders(cfg).items():
            locks.append(RunLock.acquire(folder, field))
    except BaseException:
        release(locks)
        raise
    return locks


def release(locks: list[RunLock]) -> None:
    for lock in locks:
        lock.release()




def appended_files(cfg: RunConfig) -> list[Path]:
    """The files a run appends to, step after step: the metrics.jsonl, the rollout and eval
    records (TensorBoard's event files are found in its folder)."""
    tb = cfg.logging.tensorboard_dir
    jsonl = cfg.logging.metrics_jsonl or (str(Path(tb) / "metrics.jsonl") if tb else None)
    return [Path(p) for p in (jsonl, cfg.logging.rollout_records, cfg.logging.eval_records) if p]


def set_aside_earlier_files(cfg: RunConfig) -> Path | None:
    """Rank 0, at a fresh start (nothing to resume): what an earlier attempt left in the files this
    run appends to (an attempt stopped before its first checkpoint, or an earlier run writing into
    the same folders) is moved, whole, into `<tensorboard_dir>/previous/<UTC time>/` (beside the
    first such file without a TensorBoard folder), so the new run's curves and records hold its own
    steps once and nothing is deleted; TensorBoard shows the moved events as a run of their own.
    Returns that folder, or None when there was nothing."""
    tb = Path(cfg.logging.tensorboard_dir) if cfg.logging.tensorboard_dir else None
    found = sorted(tb.glob("events.out.tfevents.*")) if tb is not None and tb.is_dir() else []
    found += [p for p in appended_files(cfg) if p.is_file()]
    if not found:
        return None
    root = (tb if tb is not None else found[0].parent) / "previous"
    dest = root / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    for n in range(1, 1000):
        if not dest.exists():
            break
        dest = root / f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{n}"
    dest.mkdir(parents=True)
    for i, path in enumerate(found):
        target = dest / path.name
        shutil.move(str(path), str(target if not target.exists() else dest / f"{i}-{path.name}"))
    return dest


def drop_records_from(cfg: RunConfig, step: int) -> None:
    """Rank 0, at a resume from the checkpoint of `step`: the rollout and eval records of steps >=
    `step` (written by the attempt that was stopped after that checkpoint) are dropped, since the
    resumed run writes them again (the metrics.jsonl: MetricsWriter's purge_step)."""
    for path in appended_files(cfg)[1:]:
        if path.is_file():
            keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) < step]
            path.write_text("".join(ln + "\n" for ln in keep))
