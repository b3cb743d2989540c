"""The folders a run writes and owns: which they are (by config field), the scratch directory every
rank can see, and the locks that make a folder one run's.

    scratch_dir(cfg, "logs")              # under checkpoint.dir (else the TensorBoard dir, ./runs)
    locks = lock_run_folders(cfg)         # rank 0: RunLockedError if another run holds one
    release(locks)

What must hold of them before a run starts (writable, room, a harmless export target, unlocked) is
checked in preflight.py.
"""
from __future__ import annotations

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


