"""What a run writes, checked before anything starts and owned while it runs; the prompt set it
was trained on, checked on resume.

    check_outputs(cfg, hf_dir)            # every output folder: writable, room for a checkpoint,
                                          # an export target that destroys nothing (one line each)
    locks = lock_run_folders(cfg)         # rank 0: RunLockedError if another run holds one
    fp = prompt_set_fingerprint(files, n) # rollout.prompt_sets: paths, bytes, records, SHA-256
    check_prompt_set(cfg, stored, fp)     # a resume over another prompt set: refused or a new epoch

Each error is one line naming the field, the path and what to do (startup.check_inputs calls
these on every rank before the first collective; nothing is written or started before them).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from gspo_megatron.checkpoint.output_dirs import (OutputDirError, check_export_target,
                                                  check_free_space, check_writable_dir)
from gspo_megatron.checkpoint.run_lock import RunLock, check_unlocked
from gspo_megatron.config import ConfigError, RunConfig


def run_root(cfg: RunConfig) -> str:
    """Where the run's scratch state lives (driver.scratch_dir's root)."""
    return cfg.checkpoint.dir or cfg.logging.tensorboard_dir or "runs"


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


def checkpoint_bytes(cfg: RunConfig, hf_dir: Path) -> int:
    """About one training checkpoint: parameters in the training dtype, plus the optimizer's
    fp32 state (Adam's two moments, and an fp32 master copy of 16-bit parameters)."""
    from gspo_megatron.actor.build import spec_for_layout
    from gspo_megatron.parallel.layout import ParallelLayout
    from model_specs.param_count import param_count
    n = param_count(spec_for_layout(hf_dir, ParallelLayout())).total
    half = cfg.model.dtype == "bfloat16"
    per_param = (2 if half else 4) + (8 if cfg.train.optimizer == "adam" else 0) + (4 if half else 0)
    return n * per_param


def check_outputs(cfg: RunConfig, hf_dir: Path, previous_checkpoint_bytes: int | None = None,
                  resuming: bool = False) -> None:
    """OutputDirError (one line) for an output the run could not write, or lack room for: one
    checkpoint (the last one's size, else estimated), plus the initial HF -> megatron conversion
    when a fresh run makes one (into checkpoint.dir: about the weight files' size)."""
    for field, path in output_fields(cfg).items():
        check_writable_dir(field, path)
    if cfg.checkpoint.export_hf:
        check_export_target("checkpoint.export_hf", cfg.checkpoint.export_hf, **export_rules(cfg))
    if cfg.checkpoint.dir:
        need = previous_checkpoint_bytes or checkpoint_bytes(cfg, hf_dir)
        what = ("one checkpoint (the last one's size)" if previous_checkpoint_bytes
                else "one checkpoint (parameters + optimizer state, estimated from the model)")
        if not resuming and not cfg.model.megatron_checkpoint:
            from gspo_megatron.checkpoint.hf_files import weight_files
            need += sum(f.stat().st_size for f in weight_files(hf_dir))
            what = "the initial conversion and " + what
        check_free_space("checkpoint.dir", cfg.checkpoint.dir, need, what)


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


# --- the prompt set ------------------------------------------------------------------------------
def prompt_set_changed(stored: dict[str, Any] | None, now: dict[str, Any]) -> str:
    """'' when the sets are the same (a moved file with the same bytes is the same set)."""
    if not stored:
        return ""
    if (stored.get("sha256"), stored.get("records")) == (now["sha256"], now["records"]):
        return ""
    return (f"the checkpoint's set was {', '.join(stored.get('paths', []))} ({stored.get('records')} "
            f"records, {stored.get('bytes')} bytes, sha256 {str(stored.get('sha256'))[:12]}), now "
            f"{', '.join(now['paths'])} ({now['records']} records, {now['bytes']} bytes, sha256 "
            f"{now['sha256'][:12]})")


def check_prompt_set(cfg: RunConfig, stored: dict[str, Any] | None, now: dict[str, Any]) -> bool:
    """On resume: True when the prompt set changed and rollout.prompts_changed=restart_epoch says
    to start a new epoch over it; ConfigError (one line) when it changed and the run refuses."""
    change = prompt_set_changed(stored, now)
    if not change:
        return False
    if cfg.rollout.prompts_changed == "restart_epoch":
        print(f"[gspo] rollout.prompts changed since the checkpoint ({change}): a new epoch over "
              "the new set starts (rollout.prompts_changed=restart_epoch)", flush=True)
        return True
    raise ConfigError(f"rollout.prompts={cfg.rollout.prompts!r} is not the prompt set the run in "
                      f"checkpoint.dir={cfg.checkpoint.dir!r} was trained on ({change}); resume with "
                      "that set, or set rollout.prompts_changed=restart_epoch to start a new epoch "
                      "over this one")


def drop_overlong_prompts(cfg: RunConfig, prompts, hf_dir: Path):
    """rollout.max_prompt_tokens: the rows kept (an index array), said in one line."""
    from transformers import AutoTokenizer

    from rollout.dataset import PromptFileError, filter_overlong
    r = cfg.rollout
    try:
        kept, dropped = filter_overlong(prompts, AutoTokenizer.from_pretrained(str(hf_dir)), r.max_prompt_tokens)
    except PromptFileError as e:
        raise PromptFileError(f"rollout.prompts={r.prompts!r}: {e}") from None
    print(f"[gspo] rollout.prompts: {dropped} of {prompts.total_rows} prompts are longer than "
          f"{r.max_prompt_tokens} tokens (rollout.max_prompt_tokens) and were dropped; {len(kept)} remain",
          flush=True)
    return kept.kept
