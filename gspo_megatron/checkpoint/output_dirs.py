"""Folders a run or a converter writes: checked before anything starts, and exports published whole.

    check_writable_dir("checkpoint.dir", "/runs/a/ck")             # one line if it cannot be written
    check_export_target("checkpoint.export_hf", "/models/out", protected={"model.hf_path": hf})
    publish_dir("/models/out", lambda tmp: write_model(tmp), source="/runs/a/ck/step_00000100")

Why exports are published, not written in place: an export written over an older one mixed old
and new files (old shards and model.safetensors.index.json beside a new model.safetensors, and
SGLang then loaded the old shards), and one pointed at an existing folder deleted it first. Now
an export is written into a fresh folder beside the target (`.NAME.gspo-tmp-PID`), marked with
EXPORT_MARKER, and renamed into place; a reader of the target sees the old folder whole, then
(after a moment with no folder at all) the new one whole, never a mix. Only a folder that
carries the marker (an earlier export of this project) or an empty one may be replaced; anything
else is refused in one line, as are targets that are, or are inside, or contain, the run's inputs
and outputs.
"""
from __future__ import annotations

import datetime
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

from gspo_megatron.checkpoint.durable import fsync_dir, write_json
from gspo_errors import InputError

EXPORT_MARKER = "gspo_export.json"


class OutputDirError(InputError, RuntimeError):
    """A folder the run would write cannot be used; the message names it and what to do."""


def _nearest_existing(path: Path) -> Path:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def check_writable_dir(field: str, path: str | Path, shown: str | Path | None = None) -> None:
    """OutputDirError unless `path` is, or can be created as, a directory this process can write:
    a file at it or on its way up, a read-only filesystem or folder, a kernel's file system (/proc,
    /sys) are named in one line (naming `shown`, the path as the user gave it, when it is not
    `path` itself). The test is a real one (a probe file created and removed in the nearest
    existing folder): the permission bits do not tell a read-only mount, and root ignores them."""
    path = Path(path)
    named = f"{field}={str(shown if shown is not None else path)!r}"
    if path.exists() and not path.is_dir():
        raise OutputDirError(f"{named} is a file, not a directory; remove it or choose another path")
    base = _nearest_existing(path)
    if not base.is_dir():
        raise OutputDirError(f"{named} cannot be created: {base} is a file, not a directory; choose "
                             "another path")
    kernel = _kernel_file_system(base)
    if kernel:
        raise OutputDirError(f"{named} cannot be written: {base} is on the kernel's {kernel} file system, "
                             "which holds no files of yours; choose another path")
    try:
        fd, probe = tempfile.mkstemp(prefix=".gspo-write-probe-", dir=base)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        why = "the filesystem is read-only" if e.errno == errno.EROFS else e.strerror
        raise OutputDirError(f"{named} cannot be written ({base}: {why}); make it writable or choose "
                             "another path") from None


# File systems the kernel presents (no user files can be made there: creating one says "No such
# file or directory" under /proc, "Permission denied" under /sys, misleading as the reason).
KERNEL_FILE_SYSTEMS = ("proc", "sysfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs",
                       "securityfs", "configfs", "pstore", "bpf", "fusectl", "efivarfs")


def _kernel_file_system(folder: Path) -> str | None:
    """The type of the kernel file system `folder` is on (the longest mount point above it in
    /proc/self/mounts), or None."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return None
    folder = _resolved(folder)
    best = max(((Path(point), kind) for point, kind in mounts
                if Path(point) == folder or Path(point) in folder.parents),
               key=lambda m: len(m[0].parts), default=None)
    return best[1] if best is not None and best[1] in KERNEL_FILE_SYSTEMS else None


def check_free_space(field: str, path: str | Path, need_bytes: int, what: str) -> None:
    """OutputDirError when the filesystem of `path` has less than `need_bytes` free."""
    free = shutil.disk_usage(_nearest_existing(Path(path))).free
    if free < need_bytes:
        raise OutputDirError(f"{field}={str(path)!r}: {_size(free)} free, {what} needs about "
                             f"{_size(need_bytes)}; free space or choose another path")


def check_free_space_together(needs: list[tuple[str, str | Path, int, str]]) -> None:
    """check_free_space for several (field, path, bytes, what) needs, those on one filesystem added
    up: a checkpoint and the weight sync's copies that share a disk must fit together."""
    by_device: dict[int, list[tuple[str, str | Path, int, str]]] = {}
    for need in needs:
        by_device.setdefault(os.stat(_nearest_existing(Path(need[1]))).st_dev, []).append(need)
    for group in by_device.values():
        field, path = group[0][0], group[0][1]
        what = " and ".join(f"{w} ({_size(n)}{f', {f}' if f != field else ''})" if len(group) > 1 else w
                            for f, _, n, w in group)
        check_free_space(field, path, sum(n for _, _, n, _ in group), what)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _resolved(path: str | Path) -> Path:
    return Path(os.path.abspath(os.path.expanduser(str(path))))


def check_export_target(field: str, target: str | Path, *,
                        protected: Mapping[str, str | Path | None] = {},
                        may_hold: Mapping[str, str | Path | None] = {}) -> None:
    """OutputDirError if an export into `target` could destroy or mix with something: `target` is,
    is inside or contains a `protected` path (inputs: the model), is or contains a `may_hold` path
    (the run's own folders, which may hold it), or it is a file, or a non-empty folder without
    EXPORT_MARKER (not an earlier export of this project)."""
    t = _resolved(target)
    for name, p in [*protected.items(), *may_hold.items()]:
        if not p:
            continue
        p = _resolved(p)
        if t == p or (name in protected and p in t.parents):
            where = "is" if t == p else "is inside"
            raise OutputDirError(f"{field}={str(target)!r} {where} {name}={str(p)!r}: the export would "
                                 f"replace or mix with it; choose a folder outside it")
        if t in p.parents:
            raise OutputDirError(f"{field}={str(target)!r} contains {name}={str(p)!r}: replacing it "
                                 "would delete that; choose another folder")
    if t.exists():
        if not t.is_dir():
            raise OutputDirError(f"{field}={str(target)!r} is a file, not a directory; remove it or "
                                 "choose another path")
        if any(t.iterdir()) and not (t / EXPORT_MARKER).is_file():
            raise OutputDirError(f"{field}={str(target)!r} is a non-empty folder that gspo-megatron did "
                                 f"not write (no {EXPORT_MARKER}); it is left alone: choose a new or "
                                 "empty folder, or remove it yourself")
    check_writable_dir(field, t.parent, shown=target)  # where it is renamed into place


def publish_dir(target: str | Path, write: Callable[[Path], Any], *, field: str = "output",
                protected: Mapping[str, str | Path | None] = {},
                may_hold: Mapping[str, str | Path | None] = {}, source: str = "") -> Path:
    """Run `write(tmp)` on a fresh folder beside `target`, mark it, and put it in place of `target`
    (which check_export_target allows to be replaced). If `write` fails, the target is untouched
    and the temporary folder removed. Returns `target`."""
    check_export_target(field, target, protected=protected, may_hold=may_hold)
    target = _resolved(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(target)
    tmp = target.with_name(f".{target.name}.gspo-tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
        write_json(tmp / EXPORT_MARKER, {
            "made_by": "gspo-megatron", "source": str(source),
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        old = target.with_name(f".{target.name}.gspo-old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
        os.rename(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)
    fsync_dir(target.parent)
    return target


def _remove_leftovers(target: Path) -> None:
    """Temporary folders of earlier publishes of `target` whose process is gone (killed midway)."""
    for p in target.parent.glob(f".{target.name}.gspo-*-*"):
        kind, _, pid = p.name.rpartition("-")
        if not (kind.endswith((".gspo-tmp", ".gspo-old")) and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
            if int(pid) != os.getpid():
                continue  # a live process on this host is publishing it
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(p, ignore_errors=True)
